"""From a call to kernel launches, without Triton or a device.

What is declared: the GPU families (:mod:`.families`), the launch configs per family
(:mod:`.configs`, :mod:`.decode_configs`), one declaration per kernel (:mod:`.declarations`; its
parameters read from its source, :mod:`.signatures`; the kernels by name, :mod:`.registry`).
The planner (:mod:`.plan`, its public face) in stages: call shapes (:mod:`.shapes`), layouts
(:mod:`.layouts`), plans and refusals (:mod:`.launches`), the attention kernels' shared part
(:mod:`.attention`), :mod:`.forward`, :mod:`.backward` and :mod:`.kvcache`."""
