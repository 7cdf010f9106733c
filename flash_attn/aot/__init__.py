"""Ahead-of-time kernels: the architectures (:mod:`.archs`), what is compiled
(:mod:`.specializations`), the build (:mod:`.build`), the manifest of shipped images
(:mod:`.manifest`), the op library that loads and launches them (:mod:`.library`), and
``python -m flash_attn info`` (:mod:`.info`)."""
