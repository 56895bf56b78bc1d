"""The chapters of the course: number -> exercise module (``labkit/<module>.py``), in order.

A chapter's files follow from it (ARCHITECTURE.md): ``chapters/NN_*.ipynb``,
``labs/NN_*.ipynb`` and ``labs/NN_*.py``, ``tests/grading/test_<module>.py``,
``tests/mutants/<module>.py``. Read by grading, ``labkit tasks`` and the layout tests;
it imports nothing, so the quick commands stay quick.
"""

CHAPTERS = {"00": "collectives", "01": "dp", "02": "ddp", "03": "zero", "04": "fsdp",
            "05": "tp", "06": "pp", "07": "sp", "08": "mesh", "09": "elastic",
            "10": "moe", "11": "compress", "12": "recompute", "13": "rpc"}
