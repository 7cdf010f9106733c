"""Placeholder for upstream's ``flash_attn.models.gptj``: not provided (see flash_attn.models)."""

from flash_attn.models import not_provided

raise not_provided("gptj")
