"""How the hivemind rows set up hivemind.Optimizer: every setting, its value in each mode, and
the line of hivemind's docs or examples it follows.

Pure data and arithmetic, no hivemind import: the worker (bench/swarm/systems/hivemind_opt.py,
in .venv-peers) builds its Optimizer from `settings()`, the unit tests check the rules in
.venv, and docs/results.md holds `settings_table()` verbatim (a test checks they agree).

Quoted sources, as found in hivemind 1.1.12 and its repository:
- OPT: hivemind/optim/optimizer.py, the Optimizer docstring's "Configuration guide";
- AVG: hivemind/averaging/averager.py, the DecentralizedAverager docstring (MATCH: the warning
  its matchmaking logs);
- QUICK: docs/user/quickstart.md, "Decentralized Training";
- ALBERT: examples/albert/run_trainer.py and examples/albert/arguments.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SYNC, LOCAL = "hivemind-sync", "hivemind-local"
DILOCO_PERIOD = 64  # the DiLoCo rows' H (bench/swarm/systems/moshpit_diloco.py)


class SettingsError(ValueError):
    """A knob combination hivemind's own docs warn against."""


@dataclass(frozen=True)
class Source:
    where: str  # file (and docstring) in hivemind's source or repository
    line: str  # quoted as written there

    def cite(self) -> str:
        return f"{self.where}: `{self.line}`"


OPT = "hivemind/optim/optimizer.py (Optimizer docstring)"
AVG = "hivemind/averaging/averager.py (DecentralizedAverager docstring)"
MATCH = "hivemind/averaging/matchmaking.py (Matchmaking.__init__)"
QUICK = "docs/user/quickstart.md"
ALBERT_TRAINER = "examples/albert/run_trainer.py"
ALBERT_ARGS = "examples/albert/arguments.py"


@dataclass(frozen=True)
class Setting:
    """One documented row: the option, its value in each mode, what it follows."""

    name: str
    sync: str
    local: str
    sources: tuple[Source, ...]
    note: str = ""


# What each mode uses unless a knob says otherwise (keys are the knobs' names).
DEFAULTS: dict[str, dict[str, Any]] = {
    SYNC: {"epoch_steps": 8, "lr_rule": "sqrt", "average_state_every": 10,
           "delayed_updates": True},
    LOCAL: {"epoch_steps": DILOCO_PERIOD, "lr_rule": "none", "average_state_every": 1,
            "delayed_updates": False},
}
COMMON: dict[str, Any] = {"matchmaking_time": 3.0, "averaging_timeout": 10.0,
                          "request_timeout": 1.5, "fp16": True}
# `--smoke` (12 s of the tiny model, 10 to 17 steps a second per host): periods short enough
# that each row averages a few times, so the smoke can check that it learns.
SMOKE_KNOBS: dict[str, dict[str, Any]] = {
    SYNC: {"epoch_steps": 16, "average_state_every": 2},
    LOCAL: {"epoch_steps": 16},
}
LR_RULES = ("sqrt", "none")


# The documented table's example: the benchmark's 4 hosts, 8 sequences per step, AdamW 1e-3
# (bench/swarm/workload.DEFAULT_HYPER; a test checks they agree).
DOC_HOSTS, DOC_BATCH, DOC_LR = 4, 8, 1e-3


def _target_cell(system: str) -> str:
    steps = DEFAULTS[system]["epoch_steps"]
    return f"hosts x batch x {steps} ({DOC_HOSTS * DOC_BATCH * steps})"


def _lr_cell(system: str) -> str:
    steps = DEFAULTS[system]["epoch_steps"]
    if DEFAULTS[system]["lr_rule"] == "none":
        return f"DDP's ({DOC_LR:.2e})"
    return f"DDP's x sqrt({steps}) ({DOC_LR * math.sqrt(steps):.2e})"


SETTINGS: tuple[Setting, ...] = (
    Setting("matchmaking_time", "3 s", "3 s", (
        Source(OPT, "matchmaking_time=15.0, # 3-5s for small local runs, 10-15s for training "
                    "over the internet or with many peers"),
        Source(QUICK, "matchmaking_time=3.0,     # when averaging parameters, gather peers in "
                      "background for up to this many seconds")),
        "4 peers with round trips under 0.2 s: a small run, though wan's links are "
        "internet-like; with target_group_size a full group forms before the time runs out"),
    Setting("averaging_timeout", "10 s", "10 s", (
        Source(QUICK, "averaging_timeout=10.0,   # give up on averaging if not successful in "
                      "this many seconds"),
        Source(OPT, "averaging_timeout=60.0,  # around of 2x the actual time it takes to run "
                    "all-reduce")),
        "a round of the 1 M-parameter model in fp16 takes about 1-2 s on wan's slowest link"),
    Setting("averager_opts target_group_size", "hosts (4)", "hosts (4)", (
        Source(AVG, ":param target_group_size: attempts to form groups with up to this many "
                    "peers (recommended: a power of 2, e.g. 16)"),
        Source(ALBERT_ARGS, 'target_group_size: int = field(default=256, metadata={"help": '
                            '"Maximum group size for all-reduce"})')),
        "every host in one group; without it a leader assembles only when its matchmaking "
        "time runs out"),
    Setting("averager_opts bandwidth", "the host's link (Mbit/s)", "the host's link (Mbit/s)", (
        Source(ALBERT_TRAINER, 'averager_opts={"bandwidth": collaboration_args.bandwidth, '
                               "**asdict(averager_args)},"),
        Source(ALBERT_ARGS, 'metadata={"help": "Available network bandwidth, in mbps (used for '
                            'load balancing in all-reduce)"},')),
        "the scenario's rate for the host (wan: 200/100/50/20), declared once at the start"),
    Setting("averager_opts request_timeout", "1.5 s", "1.5 s", (
        Source(AVG, ":note: request_timeout must be smaller than min_matchmaking_time to avoid "
                    "potential deadlocks."),
        Source(MATCH, '"It is recommended to use request_timeout smaller than '
                      'min_matchmaking_time. Otherwise,"')),
        "its default, 3 s, equals matchmaking_time here (1.1.12 logs that warning)"),
    Setting("grad_averager_factory", "GradientAverager with averager_opts", "-", (
        Source(OPT, ":param averager_opts: additional keyword arguments forwarded to both "
                    "GradientAverager and TrainingStateAverager"),),
        "1.1.12 forwards averager_opts to the state averager only; the factory makes the "
        "gradient averager get them too, as the docstring says"),
    Setting("grad_compression, state_averaging_compression", "Float16Compression",
            "Float16Compression", (
                Source(OPT, "# ^-- it is usually fine to use pure 16-bit or even lower "
                            "precision during communication with no precaution;"),
                Source(ALBERT_TRAINER, "grad_compression=Float16Compression(),")),
            "DDP fp16 and the DiLoCo rows send 16 bits or fewer too; Moshpit SGD's row "
            "sends float32 (its default codec)"),
    Setting("use_local_updates", "False", "True", (
        Source(QUICK, "use_local_updates=True,   # perform optimizer steps with local "
                      "gradients, average parameters in background"),),
        "the local mode is local AdamW plus parameter averaging: DiLoCo's rival"),
    Setting("target_batch_size", _target_cell(SYNC), _target_cell(LOCAL), (
        Source(OPT, "# It is recommended to train with very large batch sizes to reduce the % "
                    "of time spent on communication."),),
        f"local: every {DEFAULTS[LOCAL]['epoch_steps']} local steps per host, the DiLoCo rows' "
        f"period; sync: {DEFAULTS[SYNC]['epoch_steps']} steps per host per optimizer step"),
    Setting("learning rate", _lr_cell(SYNC), _lr_cell(LOCAL), (
        Source(OPT, "# tune learning rate for your target_batch_size. Here's a good reference: "
                    "https://arxiv.org/abs/1904.00962"),),
        "sync: the square-root rule (the referenced LAMB paper scales the rate with the square "
        "root of the batch; Malladi et al. 2022 derive it for Adam) from DDP's batch of "
        "hosts x batch at 1e-3; local: each step is a local AdamW step"),
    Setting("average_state_every", str(DEFAULTS[SYNC]["average_state_every"]),
            str(DEFAULTS[LOCAL]["average_state_every"]), (
        Source(OPT, ":param average_state_every: average state (parameters, chosen opt tensors) "
                    "with peers every this many **epochs**."),
        Source(OPT, "If peers hardly ever skip averaging rounds, they can average state less "
                    "frequently.")),
        "sync: the parameters only drift when a round fails; local: the parameter average is "
        "the period itself"),
    Setting("delay_optimizer_step, delay_grad_averaging", "True, True", "- (local steps)", (
        Source(OPT, "delay_grad_averaging=OPTIONAL, delay_optimizer_step=OPTIONAL, # train "
                    "faster, but with 1 round of staleness;"),
        Source(OPT, "# setting both to True is equivalent to Delayed Parameter Updates (see "
                    "https://arxiv.org/abs/2101.06840)"),
        Source(ALBERT_TRAINER, "delay_grad_averaging=True,")),
        "the round overlaps the next epoch's compute"),
    Setting("offload_optimizer, delay_state_averaging", "True, True (defaults)",
            "False, True (defaults)", (
                Source(OPT, "offload_optimizer=True,  # saves GPU memory, but increases RAM "
                            "usage; Generally a good practice to use this."),),
            "hivemind's defaults for params given as groups"),
)


@dataclass(frozen=True)
class HivemindSettings:
    """What one host passes to hivemind.Optimizer (the worker adds the compression objects and
    the gradient averager factory, which need hivemind)."""

    use_local_updates: bool
    target_batch_size: int
    lr: float
    matchmaking_time: float
    averaging_timeout: float
    target_group_size: int
    request_timeout: float
    bandwidth_mbit: float | None
    fp16: bool
    average_state_every: int
    delayed_updates: bool

    @property
    def averager_opts(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"target_group_size": self.target_group_size,
                                "request_timeout": self.request_timeout}
        if self.bandwidth_mbit is not None:
            opts["bandwidth"] = float(self.bandwidth_mbit)
        return opts

    def optimizer_kwargs(self) -> dict[str, Any]:
        """hivemind.Optimizer's keyword arguments that need no hivemind object."""
        kwargs: dict[str, Any] = {
            "target_batch_size": self.target_batch_size,
            "use_local_updates": self.use_local_updates,
            "matchmaking_time": self.matchmaking_time,
            "averaging_timeout": self.averaging_timeout,
            "average_state_every": self.average_state_every,
            "averager_opts": self.averager_opts}
        if not self.use_local_updates:
            kwargs["delay_optimizer_step"] = self.delayed_updates
            kwargs["delay_grad_averaging"] = self.delayed_updates
        return kwargs


def settings(system: str, hosts: int, batch: int, lr: float, knobs: dict[str, Any]
             ) -> HivemindSettings:
    """The settings of `system` for a swarm of `hosts` with `batch` samples per step at DDP's
    learning rate `lr`; `knobs` override DEFAULTS and COMMON by name."""
    if system not in DEFAULTS:
        raise SettingsError(f"{system!r} is not a hivemind row ({', '.join(DEFAULTS)})")
    k = {**COMMON, **DEFAULTS[system], **knobs}
    epoch_steps = int(k["epoch_steps"])
    target = int(k.get("target_batch_size", hosts * batch * epoch_steps))
    rule = str(k["lr_rule"])
    if rule not in LR_RULES:
        raise SettingsError(f"lr_rule {rule!r} is not one of {LR_RULES}")
    if target < 1 or epoch_steps < 1:
        raise SettingsError(f"target batch {target} and epoch_steps {epoch_steps} must be >= 1")
    scaled = lr * math.sqrt(target / (hosts * batch)) if rule == "sqrt" else lr
    out = HivemindSettings(
        use_local_updates=system == LOCAL, target_batch_size=target, lr=scaled,
        matchmaking_time=float(k["matchmaking_time"]),
        averaging_timeout=float(k["averaging_timeout"]),
        target_group_size=int(k.get("target_group_size", hosts)),
        request_timeout=float(k["request_timeout"]),
        bandwidth_mbit=None if k.get("bandwidth") is None else float(k["bandwidth"]),
        fp16=bool(k["fp16"]), average_state_every=int(k["average_state_every"]),
        delayed_updates=bool(k["delayed_updates"]))
    if not out.request_timeout < out.matchmaking_time:
        raise SettingsError(f"request_timeout {out.request_timeout:g} s must be smaller than "
                            f"matchmaking_time {out.matchmaking_time:g} s (hivemind's averager "
                            "docstring: else matchmaking may deadlock)")
    return out


def settings_table() -> str:
    """The markdown table docs/results.md holds."""
    head = "| setting | hivemind-sync | hivemind-local | follows | why here |"
    lines = [head, "|---|---|---|---|---|"]
    for s in SETTINGS:
        cites = "; ".join(src.cite().replace("|", "\\|") for src in s.sources)
        lines.append(f"| `{s.name}` | {s.sync} | {s.local} | {cites} | {s.note} |")
    return "\n".join(lines)
