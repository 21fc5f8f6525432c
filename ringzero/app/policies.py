"""The runtime policies the trainer's flags describe: --offload* and --zeropp*, parsed and checked.

What it is
    ``offload_policy`` (an OffloadPolicy from --offload, --offload-dir,
    --offload-ahead, --offload-delay, --offload-pin-limit, --offload-depth, --offload-threads),
    ``zeropp_policy`` (a ZeroPPPolicy from --zeropp and its knobs), and their
    checks against the stage and device, which ``config.validate`` calls. Each
    raises ConfigError: one line, exit code 2.

What it is not
    Not the policies themselves (runtime/offload.py, runtime/zeropp.py) and
    not the other flags (config.py). No MPI: the folder is only checked here;
    startup.py makes it.
"""
from __future__ import annotations

from ringzero.app.exits import ConfigError


def zeropp_policy(cfg):
    """The ZeroPPPolicy of --zeropp, --zeropp-block, --zeropp-grad-block, --zeropp-bits, --zeropp-error-feedback
    (runtime/zeropp.py)."""
    from ringzero.runtime.zeropp import ZeroPPPolicy
    try:
        return ZeroPPPolicy.parse(cfg.zeropp, block=int(cfg.zeropp_block), grad_bits=int(cfg.zeropp_bits),
                                  error_feedback=bool(cfg.zeropp_error_feedback),
                                  grad_block=int(cfg.zeropp_grad_block))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate_zeropp(cfg):
    """--zeropp: its words, its stage, and what it does not run beside (one line each)."""
    from ringzero.runtime.policy import StagePolicy
    from ringzero.runtime.zeropp import check
    pol = zeropp_policy(cfg)
    if not pol.enabled:
        for k in ("zeropp_bits", "zeropp_block", "zeropp_grad_block", "zeropp_error_feedback"):
            if getattr(cfg, k) != getattr(type(cfg), k):
                raise ConfigError(f"--{k.replace('_', '-')} is given without --zeropp: add --zeropp qwz,hpz,qgz "
                                  "(or a subset)")
        return
    if getattr(cfg, "offload_delay", None) is not None:
        raise ConfigError(f"--zeropp {cfg.zeropp} with --offload-delay: not run together (untested); HINT: drop "
                          "one of them")
    try:
        check(pol, StagePolicy.of(cfg.stage), offload_policy(cfg), cfg.overlap, cfg.prefetch)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def offload_policy(cfg):
    """The OffloadPolicy of --offload and --offload-dir (runtime/offload.py)."""
    from ringzero.runtime.host_tier import parse_pin_limit
    from ringzero.runtime.offload import OffloadError, OffloadPolicy
    try:
        pin = parse_pin_limit(cfg.offload_pin_limit)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        return OffloadPolicy.parse(cfg.offload, cfg.offload_dir, ahead=bool(cfg.offload_ahead),
                                   delay=getattr(cfg, "offload_delay", None), device=cfg.device, pin_limit=pin,
                                   **io_knobs(cfg))
    except OffloadError as e:
        raise ConfigError(str(e)) from None


def io_knobs(cfg) -> dict:
    """OffloadPolicy's buffers and io_threads of --offload-depth and --offload-threads (one line if below 1)."""
    depth, threads = getattr(cfg, "offload_depth", 2), getattr(cfg, "offload_threads", 8)
    for flag, v in (("--offload-depth", depth), ("--offload-threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{flag} must be an integer >= 1, got {v!r}")
    return {"buffers": depth + 2, "io_threads": threads}


def validate_offload(cfg):
    """--offload: its words, its stage and device, and a DIR that takes a file (or can be made: train.py makes it)."""
    from ringzero.runtime.offload import OffloadError, check_dir
    from ringzero.runtime.policy import StagePolicy
    pol = offload_policy(cfg)
    if not pol.enabled:
        if cfg.offload_ahead:
            raise ConfigError("--offload-ahead is given without --offload: add --offload optimizer")
        if getattr(cfg, "offload_delay", None) is not None:
            raise ConfigError(f"--offload-delay {cfg.offload_delay} is given without --offload: add --offload "
                              "optimizer and --offload-dir DIR")
        if cfg.offload_dir:
            raise ConfigError(f"--offload-dir {cfg.offload_dir!r} is given without --offload: add "
                              "--offload optimizer (or optimizer,params)")
        return
    try:
        pol.check(StagePolicy.of(cfg.stage), cfg.device)
        if pol.dir:                      # a device run without it: host memory
            check_dir(pol.dir, may_make=True)
    except OffloadError as e:
        raise ConfigError(str(e)) from None
