"""Packaging a conversion for people: provenance, optional verification against the source, and the model card.

``convert_checkpoint`` is the product the CLI, the ``conversion/`` script and the demo call: the library
conversion (``qkmap_hf.conversion.convert_to_folder``) plus this step, run inside the same atomic folder, so the
card, ``qkmap_conversion.json`` and ``verification.json`` appear together with the weights or not at all. It sits
above the conversion package, beside the verifier and the card writer it needs, so that conversion needs neither.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

import torch

from .conversion import ConversionError, ConversionResult, convert_to_folder
from .conversion.options import ConversionOptions, conversion_options
from .conversion.sources import DEFAULT_MAX_SHARD_BYTES
from .filenames import VERIFICATION_NAME
from .loading import ResolvedSource, is_repo_id, resolve_source
from .provenance import PROVENANCE_FILES, ConversionRecord
from .verify import DEFAULT_GENERATE_TOKENS, DEFAULT_VERIFY_TOKENS

PROVENANCE_NAME = PROVENANCE_FILES["conversion"]


def conversion_provenance(result: ConversionResult, base_model: str | None = None) -> ConversionRecord:
    """The record the card files under "Conversion": what was converted, how, and with which versions."""
    options, config, resolved = result.options, result.config, result.resolved
    return ConversionRecord(
        source=resolved.label,
        source_architecture=result.architecture,
        base_model=base_model or _guess_base_model(resolved, result.source_config),
        init=options.init,
        omega_0=options.omega0 if options.init == "exact" else None,
        num_frequencies=options.num_frequencies,
        gain_parametrization=config.qkmap_gain_parametrization,
        input_norm=bool(getattr(config, "qkmap_input_norm", False)),
        dtype=config.dtype,
        qkmap_hf_version=_qkmap_version(),
        transformers_version=_package_version("transformers"),
        torch_version=torch.__version__,
        timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        frequency_range=[config.qkmap_min_frequency, config.qkmap_max_frequency] if options.init == "native" else None,
        gguf_file=resolved.gguf_file,
        source_path=str(resolved.directory) if str(resolved.directory) != resolved.label else None,
    )


def package_conversion(
    folder: Path,
    result: ConversionResult,
    *,
    verify_text: str | os.PathLike | None = None,
    max_tokens: int = DEFAULT_VERIFY_TOKENS,
    generate_tokens: int = DEFAULT_GENERATE_TOKENS,
    base_model: str | None = None,
    progress: bool = True,
) -> ConversionRecord:
    """Write provenance, the verification report (with ``verify_text``) and README.md into ``folder``."""
    from .cards import write_model_card

    provenance = conversion_provenance(result, base_model)
    if verify_text is not None:
        from .verify import verify_conversion

        report = verify_conversion(
            result.source_model if result.source_model is not None else result.resolved.directory,
            folder,
            verify_text,
            max_tokens=max_tokens,
            generate_tokens=generate_tokens,
            tokenizer=result.tokenizer,
            source_label=result.resolved.label,
            converted_label=str(result.dst),
        )
        report.save(folder / VERIFICATION_NAME)
        if report.non_finite():  # NaN/inf logits: DST never appears (see qkmap_hf.verify)
            bad = ", ".join(report.non_finite())
            raise ConversionError(
                f"verifying {result.dst} gave non-finite {bad}; the model is broken, nothing written."
            )
        provenance.verification = report.summary()
        if progress:
            print(report.table())
    provenance.save(folder)
    write_model_card(folder, provenance=provenance, model_name=result.dst.name)
    return provenance


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    options: ConversionOptions | None = None,
    *,
    init: str | None = None,
    num_frequencies: int | None = None,
    omega0: float | None = None,
    dtype: torch.dtype | str | None = None,
    gguf_file: str | None = None,
    verify_text: str | os.PathLike | None = None,
    max_tokens: int = DEFAULT_VERIFY_TOKENS,
    generate_tokens: int = DEFAULT_GENERATE_TOKENS,
    overwrite: bool = False,
    base_model: str | None = None,
    progress: bool = True,
    cache_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Convert a Llama-style checkpoint on disk (safetensors folder, cached repo id, or GGUF) into ``dst``.

    ``dst`` loads with ``AutoModelForCausalLM.from_pretrained(dst, trust_remote_code=True)`` without qkmap_hf
    and carries its card and provenance. With ``verify_text`` the converted model is checked against the
    source before ``dst`` appears (``verification.json``). Returns ``dst``. Raises ``ConversionError``
    naming the file or field on bad input.
    """
    # bad options first, before touching SRC; built once, here, and handed on
    options = conversion_options(options, init=init, num_frequencies=num_frequencies, omega0=omega0, dtype=dtype)
    if verify_text is not None:
        from .verify import check_verify_counts

        check_verify_counts(max_tokens, generate_tokens)
    resolved: ResolvedSource = resolve_source(src, gguf_file, cache_dir)
    if verify_text is not None and not resolved.has_tokenizer:
        raise ConversionError(
            f"{resolved.directory}: no tokenizer files, so --verify cannot tokenize the text; add the source's "
            "tokenizer files or convert without --verify."
        )

    def finish(folder: Path, result: ConversionResult) -> None:
        package_conversion(
            folder,
            result,
            verify_text=verify_text,
            max_tokens=max_tokens,
            generate_tokens=generate_tokens,
            base_model=base_model,
            progress=progress,
        )

    result = convert_to_folder(
        resolved,
        dst,
        options,
        overwrite=overwrite,
        progress=progress,
        max_shard_bytes=max_shard_bytes,
        finish=finish,
    )
    return result.dst


def _guess_base_model(resolved: ResolvedSource, config: dict[str, Any]) -> str:
    if resolved.repo_id:
        return resolved.repo_id
    name = config.get("_name_or_path") or ""
    return name if is_repo_id(name, with_owner=True) and not Path(name).exists() else resolved.label


def _qkmap_version() -> str:
    from .version import __version__

    return __version__


def _package_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


__all__ = [
    "PROVENANCE_NAME",
    "VERIFICATION_NAME",
    "conversion_provenance",
    "convert_checkpoint",
    "package_conversion",
]
