"""`polyspec` command line: generate, chat, batch, zoo, tune, bench, train-draft, validate; serve, submit
and jobs (serving_cli).

A user mistake prints one line, `polyspec: error: ...`, and exits with status 2;
nothing a user can fix ends in a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from polyspec import __version__
from polyspec.harness import zoo_fetch
from polyspec.orchestrator import chain_args, serving_cli, validate
from polyspec.orchestrator.tokenization import check_stops
from polyspec.workers.core.errors import PolyspecError, RequestError, first_line
from polyspec.workers.core.heartbeat import heartbeat

EXIT_USER_ERROR = 2


PROGRESS_EVERY_S = 30.0  # batch progress lines when stderr is not a terminal

def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--max-new-tokens", type=int, default=None, help="tokens to generate (config default)")
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (config default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT",
                        help="end the generation where this text appears, without it (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="polyspec", description="Distributed multi-tier (polybasic) speculative decoding.")
    parser.add_argument("--version", action="version", version=f"polyspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt")
    chain_args.add_chain_flags(gen)
    gen.add_argument("-p", "--prompt", help="the prompt ('-': read it from stdin)")
    gen.add_argument("-f", "--file", help="read the prompt from this file")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the model's chat template")
    gen.add_argument("--system", help="with --chat: a system message before it")
    _add_sampling_flags(gen)
    gen.add_argument("--no-speculation", action="store_true", help="sample from the target alone (the baseline)")
    gen.add_argument("--json", action="store_true", help="print {text, token_ids, finish_reason, stats} as JSON")
    constrain = gen.add_mutually_exclusive_group()  # structured output, lossless (README: Structured output)
    constrain.add_argument("--json-schema", metavar="FILE", help="the reply is JSON valid against this JSON schema file")
    constrain.add_argument("--regex", metavar="REGEX", help="the reply matches this regular expression")
    constrain.add_argument("--grammar", metavar="FILE", help="the reply follows this EBNF grammar file (root ::= ...)")

    chat = sub.add_parser("chat", help="an interactive conversation (one user turn per line; /reset forgets it, Ctrl-D ends)")
    chain_args.add_chain_flags(chat)
    chat.add_argument("--system", help="a system message at the start of the conversation")
    _add_sampling_flags(chat)
    chat.add_argument("--no-speculation", action="store_true", help="sample from the target alone")

    batch = sub.add_parser("batch", help="JSONL requests in, JSONL results out")
    chain_args.add_chain_flags(batch)
    batch.add_argument("-i", "--input", required=True, help="JSONL, one request per line")
    batch.add_argument("-o", "--output", required=True, help="JSONL results, written as each request finishes")
    batch.add_argument("--no-speculation", action="store_true")
    batch.add_argument("--resume", action="store_true", help="keep results already in --output and skip their ids")
    batch.add_argument("--concurrency", type=int, default=None,
                       help="requests in flight at once (batched: default and most batching.max_requests; ray backend: default 8; round-robin: 1)")
    batch.add_argument("--stats", metavar="FILE", help="write the run's runtime stats (transport, busy/idle per tier) as JSON")

    zoo = sub.add_parser("zoo", help="models: fetch real pretrained ones, or build the demo family trained on the standard library")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True)
    zoo_build = zoo_sub.add_parser("build", help="train (or resume training) the tokenizer and models")
    zoo_build.add_argument("--out", default="models/stdlib")
    zoo_build.add_argument("--work", default=".zoo-work", help="checkpoints and token caches (resumable)")
    zoo_build.add_argument("--only", action="append", help="train only this member (repeatable)")
    zoo_build.add_argument("--threads", type=int, default=1)
    zoo_fetch.add_parsers(zoo_sub)  # fetch, list

    tune = sub.add_parser("tune", help="time model: predicted vs measured ms/token over a grid of speculation lengths")
    chain_args.add_chain_flags(tune)
    tune.add_argument("--prompts", help='JSONL, one {"prompt": ...} per line (default: prompts.jsonl beside the target model folder)')
    tune.add_argument("--temperature", type=float, default=None, help="0 = greedy (config default)")
    tune.add_argument("-n", "--max-new-tokens", type=int, default=None, help="tokens per generation (config default)")
    tune.add_argument("--grid-max", type=int, default=8, help="grid of lengths 1..K for every stage")
    tune.add_argument("--max-prompts", type=int, default=8, help="prompts used, evenly spaced through the file")
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument("--repeats", type=int, default=1, help="passes over every plan (median reported)")
    tune.add_argument("--heldout-prompts", type=int, default=16, help="held-out prompts (evenly spaced through those the tuning set left over)")
    tune.add_argument("--heldout-repeats", type=int, default=7, help="passes of the held-out comparison: best grid point vs lengths: auto (fresh and warm planner)")
    tune.add_argument("--json", action="store_true", help="print the report as JSON")

    bench = sub.add_parser("bench", help="polyspec side by side with transformers generate / assisted / prompt lookup")
    bench.add_argument("-c", "--config", required=True)
    bench.add_argument("--prompts", help="JSONL of {prompt, class} (default: prompts.jsonl beside the target model's folder)")
    bench.add_argument("-n", "--max-new-tokens", type=int, default=None, help="tokens per generation (128; --quick 48)")
    bench.add_argument("--temperature", type=float, nargs="+", default=None, help="temperatures to run (default 0 1)")
    bench.add_argument("--repeats", type=int, default=None, help="runs per prompt and system (default 1)")
    bench.add_argument("--threads", type=int, default=1, help="torch threads for every system")
    bench.add_argument("--quick", action="store_true", help="a few prompts, short generations, one repeat")
    bench.add_argument("--json", help="write the report as JSON here")
    bench.add_argument("--markdown", help="write the markdown table here")
    bench.add_argument("--plot", help="write the PNG plot here (none of the three given: all under benchmarks/)")
    bench.add_argument("--write-prompts", metavar="OUT", help="build the held-out prompt set for the config's target, then exit")
    serving_cli.add_parsers(sub)  # serve, submit, jobs
    validate.add_parser(sub)
    from polyspec.harness import train_draft_cli

    train_draft_cli.add_parser(sub)
    return parser


def _load_engine(args, batched: bool = False, chat_flag: str | None = None, reuse_prefix: bool = False):
    """The engine of the chain the flags name; every flag and config mistake is reported
    before torch or transformers is imported (chain_args). `chat_flag`: the flag that asks for
    the chat template, checked before the models load and again once the tokenizer has."""
    config = chain_args.chain_config(args)
    if chat_flag is not None:
        _check_chat_template(config.tiers[0].model, chain_args.has_chat_template(config.tiers[0].model), chat_flag)
    _log("loading torch and transformers")  # seconds on a cold start: before the first tier's line
    with heartbeat(_log, "loading torch and transformers"):
        from polyspec.orchestrator.engine import Engine

    engine = Engine(config, speculative=not args.no_speculation, batched=batched, log=_log, cache_profiles=True,
                    reprofile=args.reprofile, reuse_prefix=reuse_prefix)
    if chat_flag is not None:
        _check_chat_template(config.tiers[0].model, bool(getattr(engine.tokenizer, "chat_template", None)), chat_flag)
    return engine


def _log(message: str) -> None:
    print(f"polyspec: {message}", file=sys.stderr, flush=True)


def _read_prompt(args) -> str:
    """-p TEXT, -p - (stdin) or -f FILE."""
    if (args.prompt is None) == (args.file is None):
        raise RequestError("give the prompt as -p TEXT, -p - (read from stdin) or -f FILE" if args.prompt is None
                           else "give the prompt with -p or -f, not both")
    if args.file is not None:
        try:
            prompt = Path(args.file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RequestError(f"cannot read the prompt file {args.file}: {getattr(exc, 'strerror', None) or exc}") from None
        if not prompt:
            raise RequestError(f"the prompt file {args.file} is empty")
        return prompt
    if args.prompt == "-":
        if sys.stdin.isatty():
            print("polyspec: reading the prompt from stdin (end it with Ctrl-D)", file=sys.stderr)
        prompt = sys.stdin.read()
        if not prompt:
            raise RequestError("-p -: stdin held no prompt")
        return prompt
    if not args.prompt:
        raise RequestError("prompt is empty")  # before the models load
    return args.prompt


def _sampling_fields(args) -> dict:
    return {field: value for field, value in (
        ("max_new_tokens", args.max_new_tokens),
        ("temperature", args.temperature),
        ("top_p", args.top_p),
        ("top_k", args.top_k),
        ("seed", args.seed),
    ) if value is not None}


def _request_from_flags(args, prompt: str) -> dict:
    if args.chat:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        raw = {"messages": [*system, {"role": "user", "content": prompt}]}
    else:
        raw = {"prompt": prompt}
    return {**raw, **_sampling_fields(args), **_constraint_fields(args)}


def _constraint_fields(args) -> dict:
    """`polyspec generate`'s structured output flags as request fields: files read and the source parsed here,
    before any model loads (a bad schema, regex or grammar is one line); the engine compiles it over the tokenizer."""
    fields = {}
    if args.regex is not None:
        fields = {"regex": args.regex}
    for flag, path, field in (("--json-schema", args.json_schema, "json_schema"), ("--grammar", args.grammar, "grammar")):
        if path is None:
            continue
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise RequestError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
        if field == "json_schema":
            try:
                fields = {field: json.loads(text)}
            except ValueError as exc:
                raise RequestError(f"{flag} {path}: not valid JSON ({exc})") from None
        else:
            fields = {field: text}
    if fields:
        from polyspec.workers.core.grammar import check_source, constraint_from_fields

        check_source(constraint_from_fields(fields))
    return fields


def _check_chat_template(target: str, has_template: bool | None, flag: str) -> None:
    """`flag` asked for the chat template: refuse when the target has none (None: cannot tell yet)."""
    if has_template is False:
        raise RequestError(f"{flag}: the target model {target!r} has no chat template, so it cannot take a conversation"
                           f"{'; drop --chat to send the prompt as plain text' if flag == '--chat' else '; use polyspec generate -p TEXT'}")


def _generate(engine, request, stops: tuple[str, ...], write=None) -> dict:
    """One request through the engine's one loop, its text passed to `write` as it is committed;
    a line every few seconds while no token has come yet (a long prompt's prefill)."""
    shown = []

    def waiting(line: str) -> None:
        if not shown:
            _log(line)

    def text(delta: str) -> None:
        shown.append(delta)
        if write is not None:
            write(delta)

    with heartbeat(waiting, f"prefilling the prompt ({len(request.prompt_ids)} tokens) and the first round"):
        return engine.generate(request, stops=stops, on_text=text)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _summary(result: dict) -> str:
    stats = result["stats"]
    stages = ", ".join(f"{s['tier']}<-{s['drafter']} {s['mean_accepted_length']:.2f}" for s in stats["stages"])
    profile = f", profile {stats['profile_s']:.1f}s" if stats.get("profile_s") else ""
    return (f"[{len(result['token_ids'])} tokens, {stats['tokens_per_s']:.1f} tok/s, load {stats['load_s']:.1f}s{profile}, "
            f"prefill {stats['prefill_s']:.2f}s, decode {stats['decode_s']:.2f}s, "
            f"finish={result['finish_reason']}{', accepted/block: ' + stages if stages else ''}{_plans_summary(stats)}]")


def _plans_summary(stats: dict) -> str:
    """The planner's chains of this request (`lengths: auto`): rounds, measured and predicted tokens/s of each
    (the whole record, per plan and its lengths, is in --json's stats.plans)."""
    from polyspec.orchestrator.decode.contract import PlanTally

    tally = PlanTally()
    tally.add(stats.get("plans", []))
    shown = [f"{chain} {total['rounds']} rounds {total['measured_tokens_per_s']:.1f} tok/s"
             + (f" (predicted {total['predicted_tokens_per_s']:.1f})" if "predicted_tokens_per_s" in total else "")
             for chain, total in sorted(tally.as_dict().items(), key=lambda item: -item[1]["rounds"])]
    return f", planned: {'; '.join(shown)}" if shown else ""


def cmd_generate(args) -> int:
    if args.system is not None and not args.chat:
        raise RequestError("--system needs --chat")
    stops = check_stops(args.stop, "--stop")
    prompt = _read_prompt(args)
    raw = _request_from_flags(args, prompt)  # (a schema file that cannot be read is refused before the models load)
    engine = _load_engine(args, chat_flag="--chat" if args.chat else None)
    request = engine.parse_request(raw)
    if args.json:
        print(json.dumps(_generate(engine, request, stops)))
        return 0
    result = _generate(engine, request, stops, _write)
    sys.stdout.write("\n")
    print(_summary(result), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    """One user turn per line of stdin; the whole conversation goes to the model each turn, and its
    caches stay between turns (on every chain, Ray's included): a turn prefills only its new tokens."""
    stops = check_stops(args.stop, "--stop")
    engine = _load_engine(args, chat_flag="polyspec chat", reuse_prefix=True)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("polyspec chat: one message per line; /reset starts over, Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = list(system)  # (the kept caches stay: the next turn still shares the system message's)
            continue
        messages.append({"role": "user", "content": line})
        request = engine.parse_request({"messages": messages, **_sampling_fields(args)})
        result = _generate(engine, request, stops, _write)
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": result["text"]})
        if interactive:
            print(_summary(result), file=sys.stderr)
    return 0


def _finished_results(path: Path) -> list[str]:
    """Result lines already written (a line torn by a crash is dropped and redone)."""
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if _is_json(line)]


def cmd_batch(args) -> int:
    from tqdm import tqdm

    input_path, output_path = Path(args.input), Path(args.output)
    if not input_path.exists():
        raise RequestError(f"input file not found: {input_path}")
    if args.concurrency is not None and args.concurrency < 1:
        raise RequestError(f"--concurrency must be >= 1, got {args.concurrency}")
    lines = input_path.read_text(encoding="utf-8").splitlines()
    engine = _load_engine(args, batched=True)
    distributed = engine.config.runtime.backend == "ray"
    if not distributed and not engine.batched and (args.concurrency or 1) > 1:
        raise RequestError("--concurrency > 1 needs runtime.backend: ray or batching (the round-robin chain runs one request at a time)")
    concurrency = args.concurrency or (8 if distributed else 1)
    finished = _finished_results(output_path) if args.resume else []
    done = {str(record["id"]) for record in map(json.loads, finished) if isinstance(record, dict) and "id" in record}
    if args.resume:
        output_path.write_text("".join(line + "\n" for line in finished), encoding="utf-8")
    todo = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            request_id, raw, parse_error = _parse_line(line, number)
            if request_id not in done:
                todo.append((number, request_id, raw, parse_error))
    failures = [0]
    from polyspec.orchestrator.decode.contract import PlanTally

    chains = PlanTally()  # the planner's chains over every result (--stats: "plans")
    started = time.perf_counter()
    tokens = [0]
    reported, written = [started], [0]
    with open(output_path, "a" if args.resume else "w", encoding="utf-8") as out, \
            tqdm(total=len(todo), desc="batch", unit="req", file=sys.stderr, disable=None) as progress:

        def write(result: dict) -> None:  # (on this thread only: run_requests reports on its caller's thread)
            out.write(json.dumps(result) + "\n")
            out.flush()  # a result is on disk as soon as it is done
            os.fsync(out.fileno())
            tokens[0] += len(result.get("token_ids", ()))
            chains.add((result.get("stats") or {}).get("plans", []))
            written[0] += 1
            progress.update(1)
            now = time.perf_counter()
            if progress.disable and now - reported[0] >= PROGRESS_EVERY_S:  # not a terminal (a log file): a line now and then
                reported[0] = now
                print(f"polyspec: {written[0]}/{len(todo)} requests, {tokens[0]} tokens in {now - started:.0f}s", file=sys.stderr, flush=True)

        # the one request loop (batch_runner): a batched chain steps every running request in one round; one that is
        # not batched takes their rounds in turn (embedded: one request at a time; distributed: `concurrency` in flight)
        from polyspec.orchestrator.batch_runner import run_requests

        requests = []
        for number, request_id, raw, parse_error in todo:
            try:
                if parse_error:
                    raise RequestError(parse_error)
                requests.append(engine.parse_request({**raw, "id": request_id} if isinstance(raw, dict) else raw))
            except RequestError as exc:
                failures[0] += 1
                write({"id": request_id, "error": f"line {number}: {exc}"})
        numbers = {request_id: number for number, request_id, _, _ in todo}

        def failed(request, exc: Exception) -> None:  # this request alone: the others go on
            failures[0] += 1
            reason = first_line(exc)
            if not isinstance(exc, RequestError):
                reason = f"internal error: {reason}"
                print(f"polyspec: request {request.id!r} failed: {exc!r}", file=sys.stderr)
            write({"id": request.id, "error": f"line {numbers.get(request.id, '?')}: {reason}"})

        in_flight = min(args.concurrency or engine.max_requests, engine.max_requests) if engine.batched else concurrency
        run_requests(engine, requests, write, max_requests=in_flight, on_error=failed)
    elapsed = time.perf_counter() - started
    rate = tokens[0] / elapsed if elapsed > 0 else 0.0
    stats = {"requests": len(todo), "generated_tokens": tokens[0], "time_s": round(elapsed, 3), "tokens_per_s": round(rate, 3)}
    if distributed:
        stats.update(concurrency=concurrency, pipeline=engine.config.runtime.pipeline, batched=engine.batched,
                     max_requests=in_flight if engine.batched else None, **engine.scheduler.runtime_stats())
    else:
        stats["max_requests"] = engine.max_requests
    planner = engine.scheduler.planner
    if planner is not None:
        stats["planner"] = planner.describe()
        stats["plans"] = chains.as_dict()
    if args.stats:
        Path(args.stats).write_text(json.dumps(stats, indent=2) + "\n", encoding="utf-8")
    line = f"polyspec: {tokens[0]} tokens in {elapsed:.1f}s ({rate:.1f} tok/s)"
    if distributed:
        line += f", {stats['failovers']} target failover(s), {stats['degraded_rounds']} round(s) on a shortened chain"
        engine.close()
    print(line, file=sys.stderr)
    if failures[0]:
        print(f"polyspec: {failures[0]} request(s) failed; see their 'error' field in {output_path}", file=sys.stderr)
    return 0


def _parse_line(line: str, number: int) -> tuple[str, object, str | None]:
    """(request id, parsed object, error): the id is the line's own, or line-N."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        return f"line-{number}", None, f"malformed JSON: {exc.msg} at column {exc.colno}"
    if isinstance(raw, dict) and raw.get("id") is not None:
        return str(raw["id"]), raw, None
    return f"line-{number}", raw, None


def _is_json(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def cmd_zoo(args) -> int:
    if args.zoo_command == "fetch":
        return zoo_fetch.cmd_fetch(args)
    if args.zoo_command == "list":
        return zoo_fetch.cmd_list(args)
    from polyspec.harness.zoo import build

    build(args.out, args.work, only=args.only, threads=args.threads)
    return 0


def cmd_bench(args) -> int:
    from polyspec.harness.bench import cmd_bench as run

    return run(args)


def cmd_tune(args) -> int:
    config = chain_args.chain_config(args)  # flag and config mistakes before torch loads
    from polyspec.harness.tune import cmd_tune as run

    return run(args, config)


def cmd_train_draft(args) -> int:
    from polyspec.harness.train_draft import cmd_train_draft as run

    return run(args)


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "batch": cmd_batch, "zoo": cmd_zoo, "bench": cmd_bench, "tune": cmd_tune,
            "validate": validate.cmd_validate, "train-draft": cmd_train_draft,
            **serving_cli.COMMANDS}  # serve, submit, jobs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except PolyspecError as exc:
        print(f"polyspec: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("polyspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `polyspec ... | head`: the reader left; say nothing more (as cat and grep do)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit must not raise again
        except (OSError, ValueError):  # stdout is no file (embedded, captured)
            pass
        return 141


if __name__ == "__main__":
    sys.exit(main())
