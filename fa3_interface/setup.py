"""The version and the flash-attn pin of flash_attn_3: flash-attn's own, read from its one declaration
(flash_attn/_version.py beside this folder in the checkout and the recipe's sources), never restated."""

from pathlib import Path

from setuptools import setup

namespace: dict = {}
exec((Path(__file__).resolve().parent.parent / "flash_attn" / "_version.py").read_text(), namespace)
version = namespace["__version__"]
setup(version=version, install_requires=[f"flash-attn=={version}"])
