"""The ahead-of-time kernels' tools: the build (:mod:`.build`, ``python -m flash_attn
build-kernels``) that compiles the set of :mod:`flash_attn.aot.specializations` into a kernel folder
(images, ``manifest.json``, ``build-report.json``), the static quality report it writes per image
(:mod:`.kernel_report`), and the summary of a kernel folder and the op library (:mod:`.info`,
``python -m flash_attn info``). What runs at run time stays in :mod:`flash_attn.aot`; nothing there
imports this package."""
