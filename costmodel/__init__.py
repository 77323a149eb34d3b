"""The cost model: what engine work costs, counted and priced; nothing here runs during inference.

    flops.py       model FLOPs and bytes per step (window-limited attention, sampled-rows LM head)
    calibrate.py   this device's matmul FLOP/s and memory bandwidth, cached (``batchgen calibrate``)
    roofline.py    MFU/MBU from flops + a calibration: one model for the report, the bench and the plan
    predict.py     a planned run's engine time before it runs (``batchgen plan``)
    stats.py       percentiles of a distribution (the report and the bench)

Layering: costmodel sits on engine alone; the packages above it (pipeline/, bench/, the CLI) use it, never the
other way round.
"""
