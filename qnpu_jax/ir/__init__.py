"""The graph every engine interprets: tensors, ops and their kinds (`graph`), and the exact
integer dot products of the integer contract (`exact_dot`). Imports only numpy."""
