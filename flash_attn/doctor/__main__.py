"""``python -m flash_attn.doctor``: the same as ``python -m flash_attn doctor``."""

from flash_attn.doctor.cli import main

main()
