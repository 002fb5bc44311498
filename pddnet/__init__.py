"""pddnet: Prefill - RelayDecode - MainDecode, cross-datacenter PD disaggregation prototype."""

__version__ = "0.1.0"
