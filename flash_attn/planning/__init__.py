"""From a call to kernel launches, without Triton or a device: the limits and launch configs
per architecture (:mod:`.configs`, :mod:`.decode_configs`), one declaration per kernel
(:mod:`.declarations`), kernel argument names read from the source (:mod:`.registry`), and the
planner (:mod:`.plan`)."""
