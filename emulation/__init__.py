"""The emulated WAN between datacenter A and datacenter B: link model, shells, testbed."""
