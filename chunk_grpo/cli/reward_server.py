"""`chunk-grpo reward-server` (``python -m chunk_grpo.reward_server``): serve a reward over
HTTP; the protocol, its bounds and the batching are `chunk_grpo.rewards.server`."""

from __future__ import annotations

import argparse
import sys

from chunk_grpo.config.cli_args import (
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)
from chunk_grpo.config.commands import RewardServerConfig
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import ConfigArgumentParser

PROG = "python -m chunk_grpo.reward_server"


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0-65535 (0: a free one)."""
    port = nonnegative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number 0-65535, got {port}")
    return port


DESCRIPTION = ("Serve a registered reward (or a mix) over HTTP, for a trainer's --reward.name "
               "remote:http://HOST:PORT.")


def reward_server_parser(prog: str = PROG) -> ConfigArgumentParser:
    p = ConfigArgumentParser(RewardServerConfig, prog, DESCRIPTION,
                             "%(prog)s --reward.name SPEC --port P [--host H] [...]")
    p.add_argument("--port", type=port_number, required=True, help="TCP port (0 = a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--max-batch", type=positive_int, default=32, help="images per reward call")
    p.add_argument("--batch-wait-ms", type=nonnegative_float, default=5.0,
                   help="how long to wait for more requests to batch with the first")
    p.add_argument("--token-file", default=None,
                   help="require 'Authorization: Bearer TOKEN', TOKEN this file's first line")
    p.add_argument("--threads", type=positive_int, default=16, help="requests handled at once")
    p.add_argument("--queue", type=nonnegative_int, default=64,
                   help="requests waiting beyond those (503)")
    p.add_argument("--max-body-mb", type=positive_float, default=256.0,
                   help="largest request body (413 beyond it)")
    p.add_argument("--read-timeout", type=positive_float, default=30.0,
                   help="seconds a client may send nothing (408)")
    p.add_argument("--score-timeout", type=nonnegative_float, default=600.0,
                   help="seconds a request's reward may take (504; 0 = no limit)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    return p


def main(argv: list[str] | None = None, prog: str = PROG) -> None:
    p = reward_server_parser(prog)
    try:  # the command reports its own errors (it runs outside the one-line runner)
        own, cfg = p.parse_config(argv)
        if not cfg.reward.name:
            raise ConfigError("--reward.name is required: the reward to serve, e.g. "
                              "--reward.name pickscore or a mix a=1.0,b=0.5")
    except ConfigError as err:
        sys.stderr.write(f"{p.prog}: error: {' '.join(str(err).split())}\n")
        raise SystemExit(2) from None
    args = argparse.Namespace(**own, reward=cfg.reward.name, device=cfg.reward.device)
    # torch and the reward's models: only once the flags are good
    from chunk_grpo.config.reward_spec import RewardSpecError
    from chunk_grpo.rewards.outputs import RewardError
    from chunk_grpo.rewards.remote import read_token_file
    from chunk_grpo.rewards.server import Limits, is_loopback, serve

    try:
        token = (read_token_file(args.token_file, f"--token-file {args.token_file}")
                 if args.token_file else None)
        limits = Limits(max_body=int(args.max_body_mb * (1 << 20)),
                        read_timeout=args.read_timeout, score_timeout=args.score_timeout,
                        token=token)
        server, scorer = serve(args.reward, args.host, args.port, max_batch=args.max_batch,
                               batch_wait=args.batch_wait_ms / 1000, device=args.device,
                               verbose=args.verbose, threads=args.threads,
                               queue_size=args.queue, limits=limits)
    except (RewardSpecError, RewardError, ValueError, OSError) as err:
        sys.stderr.write(f"{p.prog}: error: {err}\n")
        raise SystemExit(2) from None
    host, port = server.server_address[:2]
    if not is_loopback(args.host):
        sys.stderr.write(f"{p.prog}: warning: --host {args.host} is not a loopback address: "
                         f"anyone who can reach port {port} can use this reward"
                         f"{'' if token else ' (give --token-file to require a token)'}\n")
    print(f"reward server: serving {args.reward!r} on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        scorer.stop()
