"""The library behind *GPT from the Ground Up*.

Each module holds one concept; every chapter builds a piece from scratch, checks it against
the matching module here, and then uses the module. See ``docs/`` and the chapters.
"""

__version__ = "0.1.0"
