"""A whole cluster paced as llama-3-70b (P and RLD on 8 x H100, MD on 8 x the source's "GPU B" in
pdd mode and on 8 x H200 in cross-dc) at time dilation
k = 3: token-exact against the colocated reference in every mode, every daemon paced and
accounting its forwards, reported times in the modelled world (/ k, never below the modelled
prefill), and the target model's KV bytes reported beside the real ones.

The roofline arithmetic itself (a forward's modelled time against hand arithmetic) is in
tests/test_emulated_devices.py; here the daemons, the WAN and the router run on that clock.
"""

from __future__ import annotations

import pytest

from pddnet.cluster.local import LocalCluster
from pddnet.device.cost import InstanceCost
from pddnet.device.profiles import load_chip, load_model
from tests.chaos.harness import precompute_references
from tests.test_cluster_e2e import assert_token_exact, make_requests, run_all

K = 3.0
DEVICES = {"prefill": "h100-sxm", "relay": "h100-sxm", "main_decode": "gpu-b"}
MD_CHIP = {"pdd": "gpu-b", "cross-dc": "h200-sxm"}
ROLES = {
    "pdd": ("prefill", "relay", "main_decode"),
    "same-dc": ("prefill", "relay"),
    "cross-dc": ("prefill", "main_decode"),
}


def emulated(mode: str) -> dict:
    out: dict = {"target_model": "llama-3-70b", "dilation": K, "wan.bw_mbit": 10000.0}
    for role in ROLES[mode]:
        out[f"{role}.device"] = MD_CHIP[mode] if role == "main_decode" else DEVICES[role]
        out[f"{role}.gpus"] = 8
    return out


@pytest.mark.timeout(170)
# same-dc and cross-dc are heavy (CI time): pdd paces P and RLD as same-dc does, and P's KV
# over the WAN and MD as cross-dc does (every branch of the checks below runs in pdd); MD paced
# as an h200-sxm is in tests/test_bench_smoke.py (ttft on emulated devices), the baselines'
# token-exactness over real processes in tests/test_cluster_e2e.py
@pytest.mark.parametrize(
    "mode",
    [
        "pdd",
        pytest.param("same-dc", marks=pytest.mark.heavy),
        pytest.param("cross-dc", marks=pytest.mark.heavy),
    ],
)
async def test_paced_cluster_is_token_exact_and_reports_modelled_times(mode):
    bodies = [b for b in make_requests(14, seed=22) if b["max_tokens"] <= 300]
    precompute_references(bodies)  # before the cluster takes the cores
    overrides = emulated(mode)
    if mode == "pdd":
        overrides["policy.pipeline"] = "p_rld_md"
    async with LocalCluster(
        mode=mode, wan="proxy", rtt_ms=30.0, jitter_ms=2.0, overrides=overrides
    ) as cluster:
        results = await run_all(cluster.url, bodies)
        assert_token_exact(bodies, results)
        stats = {r: await cluster.stats(r) for r in ROLES[mode]}
    prefill_cost = InstanceCost(load_chip("h100-sxm"), load_model("llama-3-70b"), gpus=8)
    for body, res in zip(bodies, results, strict=True):
        pdd = res["pdd"]
        assert pdd["emulation"]["dilation"] == K
        assert pdd["emulation"]["devices"]["prefill"] == "8 x h100-sxm"
        # The first token cannot come before P's paced prefill of the prompt has ended.
        assert pdd["ttft_s"] >= prefill_cost.prefill_chunk_time(0, len(body["prompt"]))
        assert pdd["timeline"][0]["t_s"] >= 0
        assert pdd["target_wan_kv_bytes"] == round(pdd["wan_kv_bytes"] * 327680 / 1024)
    for role, st in stats.items():
        dev = st["device"]
        chip = MD_CHIP[mode] if role == "main_decode" else DEVICES[role]
        assert dev["emulated"] and dev["chip"] == chip and dev["gpus"] == 8
        assert dev["target_model"] == "llama-3-70b" and dev["dilation"] == K
        assert dev["steps"] > 0 and dev["modelled_busy_s"] > 0
        assert 0 <= dev["overruns"] <= dev["steps"]
        assert dev["wire_scale"] == pytest.approx(1024 / 327680)
    if mode != "same-dc":
        kv = stats["prefill"]["lanes"]["bulk"]["bytes_out"]
        assert kv > 0
        assert stats["prefill"]["wan_bytes"]["out"]["kv_target"] == round(kv * 327680 / 1024)
    if mode != "cross-dc":
        intra = [t for t in stats["prefill"]["transport"].values() if t["target"] == "relay"]
        line = intra[0]["modelled_line"]
        # P's NICs: 8 x 400 Gbit/s, carrying real bytes that stand for llama-3-70b's, over k
        assert line["bytes_per_s"] == pytest.approx(8 * 400e9 / 8 * 1024 / 327680 / K)
        assert line["bytes"] > 0


async def test_bad_device_settings_fail_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="have no device"):
        LocalCluster(mode="pdd", run_dir=tmp_path, overrides={"target_model": "llama-3-70b"})
    with pytest.raises(ValueError, match="hold .* tokens"):
        LocalCluster(
            mode="same-dc",
            run_dir=tmp_path,
            overrides={
                "target_model": "llama-3-70b",
                "prefill.device": "h100-sxm",
                "relay.device": "h100-sxm",
            },
        )
    assert not any(tmp_path.iterdir())
