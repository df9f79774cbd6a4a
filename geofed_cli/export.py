"""``geofed export JOB --out FILE``: take a job's global model away as a standard checkpoint.

From a coordinator (the default) the export is a transfer like any other: ``POST
/v1/jobs/{job}/exports`` has the coordinator decide it under the residency policies and
audit it (``--destination storage:NAME``, or ``jurisdiction:CODE``, by default the
operator's ``GEOFED_JURISDICTION``; one the coordinator config grants the operator's
team); a denial names the rule. An allowed export lists
the signed chain (a snapshot and the updates after it), which is downloaded over the
operator's mTLS connection. With ``--store DIR`` the chain is read from a checkpoint
location's directory instead (no coordinator is asked: the bytes are already there).

Either way every artifact is verified against the federation's trust bundle (``--trust``)
and θ is rebuilt bit for bit (:mod:`geofed.export`); its hash must equal the published
one. The file is ``safetensors`` (``safetensors.torch.load_file``; the provenance, the
signed chain and the lineage are JSON in its metadata) or ``torch``
(``torch.load(f, weights_only=True)`` gives ``{"state_dict", "metadata"}``); ``hf`` writes
a Hugging Face model directory instead (:mod:`geofed.tasks.hf_export`), from the model
and tokenizer directories the job's task names (or ``--hf-model``), its weights in shards
of at most ``--max-shard-size``.

Exit codes: 0 written, 1 refused (policy, verification) or unreachable, 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from geofed.api_paths import ApiPaths
from geofed_cli.jobs import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    _connection_arguments,
    _setting,
    version_number,
)

_JURISDICTION_ENV = "GEOFED_JURISDICTION"
_SIZE_RE = re.compile(r"(\d+)\s*([a-z]*)", re.IGNORECASE)
_SIZE_UNITS = {
    **{unit: 1000**power for power, unit in enumerate(("b", "kb", "mb", "gb", "tb"))},
    **{unit: 1024**power for power, unit in enumerate(("kib", "mib", "gib", "tib"), 1)},
    "": 1,
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = subparsers.add_parser(
        "export",
        help="write a job's global model as a safetensors or torch checkpoint",
        description="Download (or read from --store) the signed snapshot and updates of a "
        "job, verify every signature and hash, rebuild θ exactly and write it as a standard "
        "checkpoint with its provenance and lineage. Exit codes: 0 written, 1 refused or "
        "unreachable, 2 usage error.",
    )
    export.add_argument("job", metavar="JOB", help="job id")
    export.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the checkpoint file to write (--format hf: the model directory)",
    )
    export.add_argument(
        "--round",
        type=version_number,
        default=None,
        help="the version θ_N to export (default: the newest published)",
    )
    export.add_argument(
        "--format",
        choices=("safetensors", "torch", "hf"),
        default="safetensors",
        help="file format; hf: a Hugging Face model directory (config.json, safetensors, "
        "generation config, tokenizer) that AutoModelForCausalLM.from_pretrained loads",
    )
    export.add_argument(
        "--hf-model",
        type=Path,
        help="--format hf: the model directory the job started from (its config.json, "
        "generation config and tokenizer); default: the job's task options' model, and "
        "its tokenizer option's directory for the tokenizer",
    )
    export.add_argument(
        "--hf-tokenizer",
        type=Path,
        help="--format hf: the tokenizer directory saved with the model; default: "
        "--hf-model's own tokenizer, else the job's task's tokenizer option",
    )
    export.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="--format hf: the weights' type (default float32: θ exactly; the other "
        "formats always write θ exactly)",
    )
    export.add_argument(
        "--max-shard-size",
        type=shard_size,
        default=None,
        metavar="SIZE",
        help="--format hf: the largest weights file; above it the weights are split into "
        "shards with model.safetensors.index.json (bytes, or a whole number with KB, MB, "
        "GB, TB or KiB, MiB, GiB, TiB; default: 5GB)",
    )
    export.add_argument(
        "--destination",
        help="where the model goes: storage:NAME or jurisdiction:CODE (default: "
        f"jurisdiction:${_JURISDICTION_ENV}); one granted to your team by the coordinator's "
        "export_destinations, then decided by the residency policies",
    )
    export.add_argument(
        "--store",
        type=Path,
        help="read the chain from this checkpoint location directory instead of a coordinator",
    )
    _connection_arguments(export)
    export.set_defaults(handler=_export)


def shard_size(text: str) -> int:
    """An argparse type for ``--max-shard-size``: bytes, or a whole number and a unit
    (KB ... TB: powers of 1000; KiB ... TiB: powers of 1024), above zero."""
    match = _SIZE_RE.fullmatch(text.strip())
    unit = _SIZE_UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: a whole number of bytes, or with a unit (100MB, 2GiB)"
        )
    size: int = int(match.group(1)) * unit
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a shard holds at least one byte")
    return size


def _export(args: argparse.Namespace) -> int:
    from geofed.export import ExportError

    try:
        _check_format_flags(args)
        trust = _trust(args)
        if args.store is not None:
            rebuilt, destination, lineage = _from_store(args, trust)
        else:
            destination = _destination(args)
            try:
                result = asyncio.run(_from_coordinator(args, trust, destination))
            except (UsageError, ExportError):
                raise
            except Exception as exc:  # network, TLS and identity failures: report and exit 1
                name = type(exc).__name__
                print(f"error: cannot reach the coordinator: {name}: {exc}", file=sys.stderr)
                return EXIT_FAILED
            if isinstance(result, int):
                return result
            rebuilt, lineage, task = result
            if args.format == "hf":
                args.hf_model, args.hf_tokenizer = hf_sources(
                    task, args.hf_model, args.hf_tokenizer
                )
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ExportError as exc:
        print(f"error: export of {args.job} refused: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if args.format == "hf":
        return _write_hf(args, rebuilt, destination, lineage)
    return _write(args, rebuilt, destination, lineage)


def _check_format_flags(args: argparse.Namespace) -> None:
    # Before anything is asked for or written: the flag would be ignored.
    if args.format == "hf":
        if args.hf_tokenizer is not None:
            _check_tokenizer(args.hf_tokenizer)
        return
    if args.max_shard_size is not None:
        raise UsageError(f"--max-shard-size is for --format hf; a {args.format} export is one file")
    if args.dtype is not None:
        raise UsageError(
            f"--dtype is for --format hf; a {args.format} export is θ exactly, in float32"
        )
    for flag, value in (("--hf-model", args.hf_model), ("--hf-tokenizer", args.hf_tokenizer)):
        if value is not None:
            raise UsageError(
                f"{flag} is for --format hf; a {args.format} export has no model directory"
            )


def _trust(args: argparse.Namespace) -> Any:
    from geofed.pki import load_trust_bundle

    trust = _setting(args, "trust")
    if not trust:
        raise UsageError("verifying the chain needs the trust bundle: --trust or GEOFED_TRUST")
    return load_trust_bundle(Path(trust))


def _destination(args: argparse.Namespace) -> str:
    if args.destination:
        return str(args.destination)
    jurisdiction = os.environ.get(_JURISDICTION_ENV)
    if not jurisdiction:
        raise UsageError(
            "say where the model goes: --destination storage:NAME|jurisdiction:CODE, "
            f"or set {_JURISDICTION_ENV} to your jurisdiction"
        )
    return f"jurisdiction:{jurisdiction}"


async def _from_coordinator(
    args: argparse.Namespace, trust: Any, destination: str
) -> tuple[Any, dict[str, Any] | None, Any] | int:
    """Ask for the export, download its chain, rebuild; an exit code if refused."""
    from geofed.export import parse_plan, rebuild

    async with _Session(args, trust) as session:
        body = {"destination": destination, "round": args.round}
        status, answer = await session.json("POST", ApiPaths.exports(args.job), body)
        if status != 201:
            return _refused(status, answer)
        plan = parse_plan(args.job, answer)
        bundles = [await session.download(part.url or "") for part in plan.parts]
    rebuilt = await asyncio.to_thread(rebuild, plan, bundles, trust, now=datetime.now(UTC))
    # The lineage comes from the verified chain itself (the last update's signed manifest).
    return rebuilt, None, answer.get("task")


def _from_store(args: argparse.Namespace, trust: Any) -> tuple[Any, str | None, None]:
    from coordinator.jobs.init_source import rebuild_version
    from coordinator.storage.artifacts import Location
    from coordinator.storage.checkpoints import CheckpointError, CheckpointStore
    from geofed.blobstore import FsBlobStore
    from geofed.export import ExportError
    from geofed.types import InvalidName, validate_name

    root: Path = args.store
    if args.format == "hf" and args.hf_model is None:
        raise UsageError("--format hf with --store needs --hf-model: the job's model directory")
    if args.format == "hf":
        args.hf_model, args.hf_tokenizer = hf_sources(None, args.hf_model, args.hf_tokenizer)
    if not (root / "jobs").is_dir():
        raise UsageError(f"{root} is not a checkpoint location (no jobs/ directory)")
    try:
        name = validate_name("checkpoint location", root.name)
    except InvalidName:
        name = "local"
    blobs = FsBlobStore(root / "blobs")
    location = Location(name, "", None, CheckpointStore(name, root, blobs=blobs), blobs)
    try:
        entries = location.store.entries(args.job)
    except CheckpointError as exc:
        raise ExportError(str(exc)) from None
    newest = max((e.round + (e.kind.value == "update") for e in entries), default=None)
    if newest is None:
        raise ExportError(f"{root} holds no checkpoint of job {args.job}")
    round_ = newest if args.round is None else args.round
    return rebuild_version(location, args.job, round_, trust), args.destination, None


def _write(args: argparse.Namespace, rebuilt: Any, destination: str | None, lineage: Any) -> int:
    import torch

    from geofed.export import export_metadata, safetensors_bytes, torch_checkpoint
    from geofed.fsutil import atomic_write_bytes

    metadata = export_metadata(
        rebuilt, exported_at=datetime.now(UTC), destination=destination, lineage=lineage
    )
    if args.format == "safetensors":
        data = safetensors_bytes(rebuilt.params, metadata)
    else:
        buffer = io.BytesIO()
        torch.save(torch_checkpoint(rebuilt.params, metadata), buffer)
        data = buffer.getvalue()
    try:
        atomic_write_bytes(args.out, data)
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    numel = sum(t.numel() for t in rebuilt.params.values())
    summary = {
        "job": rebuilt.job,
        "round": rebuilt.round,
        "parameters_hash": rebuilt.params_hash,
        "file": str(args.out),
        "format": args.format,
        "bytes": len(data),
        "tensors": len(rebuilt.params),
        "parameters": numel,
        "chain": [[a.manifest.kind.value, a.manifest.round] for a in rebuilt.artifacts],
        "destination": destination,
        "lineage": "lineage" in metadata,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        print(
            f"exported {rebuilt.job} θ_{rebuilt.round} (parameters hash "
            f"{rebuilt.params_hash}) to {args.out}: {args.format}, {len(data)} bytes, "
            f"{len(rebuilt.params)} tensors, {numel} parameters; rebuilt from the snapshot "
            f"of θ_{rebuilt.artifacts[0].manifest.round} and {len(rebuilt.artifacts) - 1} "
            "update(s), every signature and hash verified"
        )
    return EXIT_OK


_HF_TASK = "geofed.tasks.hf:CausalLMTask"


def hf_sources(
    task: Any, hf_model: Path | None, hf_tokenizer: Path | None = None
) -> tuple[Path, Path | None]:
    """The model directory θ is exported as and the tokenizer directory saved with it.

    ``hf_model`` (``--hf-model``) wins, with its own tokenizer if it has one; otherwise
    the job's task (as the coordinator's export answer names it) gives its ``model`` and
    its ``tokenizer`` option, which defaults to the model directory's tokenizer.
    ``hf_tokenizer`` (``--hf-tokenizer``) wins over either for the tokenizer.
    """
    if hf_tokenizer is not None:
        _check_tokenizer(hf_tokenizer)
        model_dir, _ = hf_sources(task, hf_model)
        return model_dir, hf_tokenizer
    if hf_model is not None:
        return hf_model, hf_model if _has_tokenizer(hf_model) else None
    spec = task.get("spec") if isinstance(task, dict) else None
    options = task.get("options") if isinstance(task, dict) else None
    model = options.get("model") if isinstance(options, dict) else None
    if spec != _HF_TASK or not isinstance(model, str):
        raise UsageError(
            f"--format hf: the job's task is {spec or 'not named'}, not {_HF_TASK}; name "
            "the Hugging Face directory whose architecture θ has with --hf-model"
        )
    tokenizer = options.get("tokenizer") if isinstance(options, dict) else None
    if isinstance(tokenizer, str):
        # The task's tokenizer, wherever it is: the model directory may hold another one.
        return Path(model), Path(tokenizer)
    return Path(model), Path(model) if _has_tokenizer(Path(model)) else None


def _write_hf(args: argparse.Namespace, rebuilt: Any, destination: str | None, lineage: Any) -> int:
    from geofed.export import export_metadata
    from geofed.tasks.hf_model import HfModelError

    try:
        from geofed.tasks.hf_export import DEFAULT_SHARD_SIZE, write_hf_export

        metadata = export_metadata(
            rebuilt, exported_at=datetime.now(UTC), destination=destination, lineage=lineage
        )
        written = write_hf_export(
            args.out,
            rebuilt.params,
            model_dir=args.hf_model,
            tokenizer_dir=args.hf_tokenizer,
            metadata=metadata,
            params_hash=rebuilt.params_hash,
            dtype=args.dtype or "float32",
            max_shard_size=args.max_shard_size or DEFAULT_SHARD_SIZE,
        )
    except HfModelError as exc:
        print(f"error: cannot export {args.job} as a Hugging Face model: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    summary = {
        "job": rebuilt.job,
        "round": rebuilt.round,
        "parameters_hash": rebuilt.params_hash,
        "directory": str(args.out),
        "format": "hf",
        "architecture": written.architecture,
        "dtype": written.dtype,
        "files": list(written.files),
        "bytes": written.bytes,
        "missing_keys": list(written.missing_keys),
        "unexpected_keys": list(written.unexpected_keys),
        "hash_matches": written.hash_matches,
        "destination": destination,
    }
    if args.json:
        json.dump(summary, sys.stdout, indent=2, sort_keys=True)
        print()
    else:
        checked = "the published parameters hash" if written.hash_matches else f"{written.dtype}"
        print(
            f"exported {rebuilt.job} θ_{rebuilt.round} to {args.out} as a Hugging Face "
            f"{written.architecture} ({written.dtype}, {written.bytes} bytes: "
            f"{', '.join(written.files)}); transformers loads it with no missing or "
            f"unexpected key, and its weights have {checked}"
        )
    return EXIT_OK


def _check_tokenizer(directory: Path) -> None:
    if not _has_tokenizer(directory):
        raise UsageError(
            f"--hf-tokenizer {directory}: no tokenizer.json or tokenizer_config.json there"
        )


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def _refused(status: int, answer: Any) -> int:
    body = answer if isinstance(answer, dict) else {}
    code = body.get("error", f"http_{status}")
    message = body.get("message", str(answer)[:500])
    print(f"error: {code} ({status}): {message}", file=sys.stderr)
    return EXIT_FAILED


class _Session:
    """The operator's connection to the coordinator (see :mod:`geofed_cli.jobs`)."""

    def __init__(self, args: argparse.Namespace, trust: Any) -> None:
        self._args = args
        self._trust = trust
        self._session: Any = None
        self._url = ""

    async def __aenter__(self) -> _Session:
        import aiohttp
        from yarl import URL

        from geofed.loopback import is_loopback
        from geofed.pki import client_ssl_context
        from geofed.pki.httpauth import VerifiedConnector
        from geofed.types import Role

        url = _setting(self._args, "url")
        if not url:
            raise UsageError("no coordinator URL: pass --url or set GEOFED_URL (or use --store)")
        self._url = url.rstrip("/")
        headers: dict[str, str] = {}
        connector: aiohttp.BaseConnector | None = None
        if self._url.startswith("http://"):
            if not is_loopback(URL(self._url).host or ""):
                raise UsageError("plain http is only for the loopback demo; use https://")
            identity = _setting(self._args, "identity")
            if not identity:
                raise UsageError("an http:// coordinator needs --identity or GEOFED_IDENTITY")
            headers["X-Geofed-Identity"] = identity
        elif self._url.startswith("https://"):
            cert, key = _setting(self._args, "cert"), _setting(self._args, "key")
            if not cert or not key:
                raise UsageError("https needs a client certificate: --cert and --key")
            context = client_ssl_context(self._trust, Path(cert), Path(key))
            connector = VerifiedConnector(self._trust, context, expect=Role.COORDINATOR)
        else:
            raise UsageError(f"coordinator URL must start with https://: {self._url}")
        timeout = aiohttp.ClientTimeout(total=None, sock_read=self._args.timeout)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def json(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        async with self._session.request(method, self._url + path, json=body) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text

    async def download(self, path: str) -> bytes:
        from geofed.export import ExportError

        async with self._session.get(self._url + path) as response:
            if response.status != 200:
                text = await response.text()
                raise ExportError(f"GET {path}: {response.status} {text[:300]}")
            data: bytes = await response.read()
            return data
