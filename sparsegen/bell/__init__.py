"""Block-ELL weights: block-sparse with the same number of stored blocks in every block row.

A layout through the layout kit (gathered_specs.py, gathered.py; docs/adding-a-layout.md):
what is its own is the format and its index check (format), the column rule of its template
(templates/bell/), its op's reference, dense weight and stored blocks (ops: the kit trains
on them) and its nn module (nn).
"""
