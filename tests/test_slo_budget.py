"""The SLO as a serving setting (issue 55): the SLO in force sizes chunked systems' token budgets
(Sarathi-Serve's rule at its TPOT / token-gap limit), the prefill role's own budget, TTFT-slack
placement, and serve's start-up line; on the shipped simulated V100 profile (no model weights)."""
import pytest

from aserve.commands import build_parser
from aserve.commands.common import engine_and_cluster
from aserve.devices.measured import BUDGET_DECODE_BATCH
from aserve.devices.sim_device import load_profile
from aserve.replay.slo import Term, UnloadedCosts, build_slo

DEVICE = "sim:opt-13b-v100-32gb"
COST = load_profile("opt-13b-v100-32gb").cost
V100 = UnloadedCosts(COST, DEVICE)
CONTEXT = 1000  # the workload's longest prompt + output, where the budget holds its step time


def replay_args(*flags):
    return build_parser().parse_args(["replay", "t.jsonl", "--device", DEVICE, *flags])


def corner(name):
    return build_slo(name, None, lambda: V100)


def test_the_step_limit_is_the_smaller_of_tpot_and_the_token_gap():
    step = V100.step_s(CONTEXT)
    assert corner("balanced").step_limit_s(CONTEXT) == pytest.approx(5 * step)  # TPOT 5 steps < gap 25
    assert corner("tight-tpot").step_limit_s(CONTEXT) == pytest.approx(2 * step)
    assert corner("tight-ttft").step_limit_s(CONTEXT) == pytest.approx(25 * step)
    assert corner("balanced").step_limit_s(CONTEXT, ("token_gap",)) == pytest.approx(25 * step)
    absolute = build_slo("ttft:250,tpot:100", None)  # vLLM's form, milliseconds, also in --slo
    assert dict(absolute.terms) == {"ttft": Term(seconds=0.25), "tpot": Term(seconds=0.1)}
    assert absolute.step_limit_s(CONTEXT) == 0.1 and build_slo("ttft=1", None).step_limit_s(CONTEXT) is None


def test_the_slo_in_force_sizes_every_chunked_systems_budget():
    """Every chunked system by its token gap (Sarathi-Serve's per-token bound; --tbt-slo tpot: the
    smaller of TPOT and gap); vllm and the split's systems have no such budget."""
    slo, step = corner("balanced"), V100.step_s(CONTEXT)
    device_rule = COST.token_budget(COST.decode_slo_s(BUDGET_DECODE_BATCH, CONTEXT), BUDGET_DECODE_BATCH, CONTEXT)
    for flags, tbt in ((["--mode", "coupled", "--instances", "4", "--batching", "sarathi"], 25 * step),
                       (["--mode", "coupled", "--batching", "alise"], 25 * step),
                       (["--mode", "adaptive", "--prefill", "2", "--decode", "2"], 25 * step),
                       (["--mode", "adaptive", "--tbt-slo", "tpot"], 5 * step),
                       (["--mode", "coupled", "--tbt-slo", "tpot"], 5 * step),
                       (["--mode", "adaptive", "--tbt-slo", "gap"], 25 * step)):
        engine, _ = engine_and_cluster(replay_args(*flags), CONTEXT, slo)
        assert engine.tbt_slo == pytest.approx(tbt)
        assert engine.max_num_batched_tokens == COST.token_budget(engine.tbt_slo, BUDGET_DECODE_BATCH, CONTEXT)
    # balanced's gap allows longer steps than 5x a 32-decode step, its TPOT shorter ones
    assert COST.token_budget(5 * step, BUDGET_DECODE_BATCH, CONTEXT) < device_rule < COST.token_budget(
        25 * step, BUDGET_DECODE_BATCH, CONTEXT)
    # no SLO, or --tbt-slo device: the device's rule, as before
    for a, s in ((replay_args("--mode", "coupled"), None), (replay_args("--mode", "coupled", "--tbt-slo", "device"), slo)):
        engine, _ = engine_and_cluster(a, CONTEXT, s)
        assert engine.tbt_slo is None and engine.max_num_batched_tokens == device_rule
    for flags in (["--mode", "coupled", "--batching", "vllm"], ["--mode", "disagg"]):
        assert engine_and_cluster(replay_args(*flags), CONTEXT, slo)[0].tbt_slo is None
    # explicit seconds and an explicit budget win
    assert engine_and_cluster(replay_args("--mode", "coupled", "--tbt-slo", "0.3"), CONTEXT, slo)[0].tbt_slo == 0.3
    assert engine_and_cluster(replay_args("--mode", "coupled", "--max-num-batched-tokens", "100"), CONTEXT,
                              slo)[0].max_num_batched_tokens == 100


def test_adaptive_prefill_instances_can_have_their_own_budget():
    slo, gap = corner("balanced"), 25 * V100.step_s(CONTEXT)
    engine, cluster = engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, slo)
    assert cluster.prefill_tbt_slo == pytest.approx(gap) == engine.tbt_slo  # by default both the gap's
    assert cluster.prefill_token_budget == engine.max_num_batched_tokens
    engine, cluster = engine_and_cluster(replay_args("--mode", "adaptive", "--tbt-slo", "tpot", "--prefill-tbt-slo",
                                                     "gap"), CONTEXT, slo)
    assert engine.tbt_slo == pytest.approx(5 * V100.step_s(CONTEXT)) and cluster.prefill_tbt_slo == pytest.approx(gap)
    assert cluster.prefill_token_budget == COST.token_budget(gap, BUDGET_DECODE_BATCH, CONTEXT) > \
        engine.max_num_batched_tokens
    from aserve.engine.policies import Policies

    policies = Policies.from_configs(engine, cluster)
    assert policies.role_budget("prefill") == cluster.prefill_token_budget
    assert policies.role_budget("decode") == engine.max_num_batched_tokens
    same = engine_and_cluster(replay_args("--mode", "adaptive", "--prefill-tbt-slo", "same"), CONTEXT, slo)[1]
    assert same.prefill_token_budget is None and same.prefill_tbt_slo is None
    for rule in ("device", "gap", "0.5"):  # a budget rule chosen by hand: one budget unless the prefill's is named
        assert engine_and_cluster(replay_args("--mode", "adaptive", "--tbt-slo", rule), CONTEXT,
                                  slo)[1].prefill_token_budget is None


def test_slo_placement_and_order_read_the_ttft_limit():
    slo = corner("balanced")
    _, cluster = engine_and_cluster(replay_args("--mode", "adaptive", "--slo-placement", "--slo-slack", "0.7"),
                                    CONTEXT, slo)
    assert cluster.ttft_slo == (0.0, 3.0, 5.0) and cluster.placement_slack == 0.7
    assert cluster.slo_placement and not cluster.slo_order
    from aserve.cluster.cluster import Cluster

    placement = Cluster(*engine_and_cluster(replay_args("--mode", "adaptive", "--slo-placement"), CONTEXT, slo)).placement
    assert placement.config.slo_placement and placement.config.ttft_slo == (0.0, 3.0, 5.0)
    _, ordered = engine_and_cluster(replay_args("--mode", "adaptive", "--slo-order", "--no-slo-placement"), CONTEXT, slo)
    assert ordered.slo_order and not ordered.slo_placement and ordered.ttft_slo == (0.0, 3.0, 5.0)
    from aserve.engine.policies import Policies

    assert Policies.from_configs(*engine_and_cluster(replay_args("--mode", "adaptive", "--slo-order"), CONTEXT,
                                                     slo)).deadline_order
    default = engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, slo)[1]
    assert default.slo_placement and default.ttft_slo == (0.0, 3.0, 5.0) and not default.slo_order  # on by default
    for off in (engine_and_cluster(replay_args("--mode", "adaptive", "--no-slo-placement"), CONTEXT, slo)[1],
                engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, None)[1],  # no SLO in force
                engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, build_slo("tpot=100ms", None))[1]):
        assert off.ttft_slo is None and not off.slo_placement and not off.slo_order
    with pytest.raises(ValueError, match="--slo-placement and --slo-order read each prompt's TTFT limit"):
        engine_and_cluster(replay_args("--mode", "adaptive", "--slo-placement", "--slo-order"), CONTEXT,
                           build_slo("tpot=100ms", None))
    with pytest.raises(ValueError, match="--slo-slack must be in"):
        engine_and_cluster(replay_args("--mode", "adaptive", "--slo-placement", "--slo-slack", "2"), CONTEXT, slo)


def test_tpot_placement_reads_the_tpot_limit_wherever_the_slo_has_one():
    from aserve.cluster.cluster import Cluster

    default = engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, corner("tight-tpot"))
    assert default[1].tpot_slo == (0.0, 2.0)
    assert Cluster(*default).placement.config.tpot_slo == (0.0, 2.0)  # what the placement prices with
    assert engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, build_slo("tpot=100ms", None))[1].tpot_slo \
        == (0.1, 0.0)
    for off in (engine_and_cluster(replay_args("--mode", "adaptive", "--no-tpot-placement"), CONTEXT, corner("balanced"))[1],
                engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, None)[1],
                engine_and_cluster(replay_args("--mode", "adaptive"), CONTEXT, build_slo("ttft=1", None))[1],
                engine_and_cluster(replay_args("--mode", "coupled", "--batching", "sarathi"), CONTEXT, corner("balanced"))[1]):
        assert off.tpot_slo is None
    with pytest.raises(ValueError, match="--tpot-placement reads each decode's TPOT limit"):
        engine_and_cluster(replay_args("--mode", "adaptive", "--tpot-placement"), CONTEXT, build_slo("ttft=1", None))


def test_bad_budget_flags_are_named():
    with pytest.raises(ValueError, match="--tbt-slo gap sizes a token budget for the SLO in force"):
        engine_and_cluster(replay_args("--mode", "coupled", "--tbt-slo", "gap"), CONTEXT, None)
    with pytest.raises(ValueError, match="--prefill-tbt-slo tpot sizes a token budget"):
        engine_and_cluster(replay_args("--mode", "adaptive", "--prefill-tbt-slo", "tpot"), CONTEXT, build_slo("ttft=1", None))
    for flag in ("--tbt-slo", "--prefill-tbt-slo"):
        with pytest.raises(SystemExit):
            replay_args(flag, "fast")
        for bad in ("0", "-1", "nan"):
            with pytest.raises(ValueError, match=f"{flag} must be > 0"):
                engine_and_cluster(replay_args("--mode", "adaptive", flag, bad), CONTEXT, corner("balanced"))


def test_serve_names_its_slo_and_profiles_nothing_it_does_not_need(capsys):
    from aserve.commands.serve import serve_slo, slo_line

    a = build_parser().parse_args(["serve", "--device", DEVICE, "--mode", "adaptive", "--prefill", "1", "--decode", "1"])
    slo = serve_slo(a)
    assert slo.name == "balanced"  # the default corner
    engine, cluster = engine_and_cluster(a, slo=slo)
    line = slo_line(a, slo, engine, cluster)
    assert line.startswith("SLO balanced (ttft <= 3 x prefill + 5 x step; tpot <= 5 x step; token_gap <= 25 x step)")
    assert f"token budget {engine.max_num_batched_tokens} (steps <=" in line and "sized for this SLO's gap)" in line
    assert f"prefill instances {cluster.prefill_token_budget}" in line and DEVICE in line
    fixed = build_parser().parse_args(["serve", "--device", DEVICE, "--slo", "ttft:500,tpot:80", "--chunk-size", "64",
                                       "--max-num-batched-tokens", "256"])
    slo = serve_slo(fixed)
    engine, cluster = engine_and_cluster(fixed, slo=slo)
    assert slo_line(fixed, slo, engine, cluster) == "SLO custom (ttft <= 500 ms; tpot <= 80 ms); token budget 256"
    lazy = serve_slo(build_parser().parse_args(["serve", "--device", DEVICE, "--max-num-batched-tokens", "256",
                                                "--chunk-size", "64"]))
    engine, cluster = engine_and_cluster(build_parser().parse_args(
        ["serve", "--device", DEVICE, "--max-num-batched-tokens", "256", "--chunk-size", "64"]), slo=lazy)
    assert not lazy.costs.resolved  # every setting given: the corner's costs were never needed
    with pytest.raises(ValueError, match="unknown SLO corner 'tight'"):
        serve_slo(build_parser().parse_args(["serve", "--slo", "tight"]))


def test_serve_sizes_each_step_at_the_slos_tpot():
    """serve (coupled sarathi) sizes a step's prompts at its decodes' contexts within the SLO's
    TPOT limit (``--step-limit tpot``), a step with no decodes within its token gap, the token
    budget a floor: its schedulers carry that room, and the start-up line says so. ``--step-limit
    gap`` / seconds (one limit for every step), ``--step-budget fixed`` and a given
    ``--max-num-batched-tokens`` change it; a bad limit is named."""
    from aserve.commands.serve import serve_slo, slo_line
    from aserve.devices.measured import instance_threads, measured_cost, model_context, step_room
    from aserve.engine.policies import Policies

    def serve(*flags):
        a = build_parser().parse_args(["serve", "--device", DEVICE, *flags])
        slo = serve_slo(a)
        return a, slo, *engine_and_cluster(a, slo=slo)

    a, slo, engine, cluster = serve()
    ctx = engine.budget_context or model_context(engine)  # the simulated model's context window
    gap = slo.step_limit_s(ctx, ("token_gap",))
    assert engine.step_budget == "sized" and engine.step_limit_s == pytest.approx(slo.step_limit_s(ctx))
    assert engine.step_limit_s < gap == pytest.approx(engine.step_limit_alone_s)
    assert gap == engine.tbt_slo  # the time the budget itself is sized for
    room = Policies.from_configs(engine, cluster, step_room(engine, cluster)).batching_config.step_room
    cost = measured_cost(engine, instance_threads(engine, cluster))  # the device's cost model
    assert room is not None and room.limit_s == engine.step_limit_s and room.alone_s == engine.step_limit_alone_s
    assert room.step_s(64, 100, 4, 1200) == cost.room_step_s(64, 100, 4, 1200) == cost.step_s([(64, 100)], [300] * 4, num_sampled=5)
    line = slo_line(a, slo, engine, cluster)
    assert f"leave room in {engine.step_limit_s * 1000:.0f} ms ({gap * 1000:.0f} ms in a step with no decodes)" in line
    # a prompt alone gets the token gap's rows: more than the budget, sized for 32 decodes at the
    # whole context in that time, and more than beside one decode at TPOT
    assert room.rows(0, 0, 0, 1 << 14) > max(engine.max_num_batched_tokens, room.rows(1, 10, 0, 1 << 14))
    assert serve("--step-limit", "tpot")[2] == engine
    engine, cluster = serve("--step-limit", "gap")[2:]
    assert engine.step_limit_s == pytest.approx(gap) and engine.step_limit_alone_s is None
    room = Policies.from_configs(engine, cluster, step_room(engine, cluster)).batching_config.step_room
    # beside few short decodes a step within the gap holds far more than the budget
    assert room.rows(4, 4 * 300, 0, 1 << 14) > engine.max_num_batched_tokens
    assert serve("--step-limit", "0.25")[2].step_limit_s == 0.25
    assert serve("--step-limit", "0.25")[2].step_limit_alone_s is None
    for flags in (["--step-budget", "fixed"], ["--max-num-batched-tokens", "256"]):
        engine, cluster = serve(*flags)[2:]
        assert engine.step_budget == "fixed" and step_room(engine, cluster) is None
    with pytest.raises(ValueError, match="--step-limit must be > 0"):
        serve("--step-limit", "0")
    with pytest.raises(ValueError, match="bad step_budget 'sometimes'"):
        serve("--step-budget", "sometimes")
