"""Accelerators the testbed does not have, modelled: chip and model profiles (TOML data), the
roofline cost of one forward, and what the daemons need to run on a modelled accelerator's
clock (step pacing with overrun accounting, time dilation, the target model's bytes on the
wire). The simulator and the engine import the same cost function from here."""
