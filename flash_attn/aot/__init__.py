"""Ahead-of-time kernels at run time: the architectures (:mod:`.archs`), the set of compiled
specialisations and the keys that name their images (:mod:`.specializations`), the manifest of
shipped images (:mod:`.manifest`), and the op library that loads and launches them
(:mod:`.library`). The build that compiles them is :mod:`flash_attn.kernel_build`."""
