"""`qnpu report`: results tables in the shape of the paper's Table 1 and its pictures.

`table` reads run directories and `qnpu eval --json` files into rows and renders them;
`plots` draws PNGs with matplotlib's Agg canvas; `build` puts both into NAME.md, NAME.html,
NAME.json and NAME/*.png. Nothing here imports JAX or matplotlib at package import.
"""

from qnpu_jax.report.build import (
    Report,
    Section,
    assemble,
    build_report,
    table_sections,
    write_report,
)

__all__ = ["Report", "Section", "assemble", "build_report", "table_sections", "write_report"]
