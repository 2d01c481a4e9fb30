"""edgec command line: parse, call one function, print. No logic lives here."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import click

from edgec.errors import EdgecError
from edgec.kvcache.compression import Compression


class _Group(click.Group):
    """Turns any EdgecError, and any bad option or argument, into one line on stderr and exit code 2."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except EdgecError as error:
            click.echo(f"error: {error}", err=True)
            sys.exit(2)
        except click.UsageError as error:
            command = f" (see edgec {error.ctx.info_name} --help)" if error.ctx is not None else ""
            click.echo(f"error: {error.format_message()}{command}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(package_name="edgec")
def main() -> None:
    """Compile a decoder-only language model into a bundle that runs offline on one target."""


# the compressed cache's options come from its settings type: flag, help, choices and default are declared once
def kv_options(command=None, *, at_load: bool = False):
    """Add one option per compressed-cache setting that has a flag (``Compression``'s fields); ``at_load``: only
    those a built bundle may change (for ``edgec run``), defaulting to the bundle's."""

    def add(command):
        for _, default, option in reversed(Compression.options()):
            if option.flag is None or (at_load and not option.at_load):
                continue
            choices = option.allowed()
            kind = click.Choice(choices) if choices else (type(default) if default is not None else int)
            shown = "[the bundle's]" if at_load else f"[default: {option.default_text or default}]"
            command = click.option(
                option.flag, type=kind, default=None, help=f"Compressed cache: {option.help} {shown}"
            )(command)
        return command

    return add(command) if command is not None else add


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--target", "-t", default="cpu", show_default=True, help="Target name (see targets/).")
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Bundle folder to write.")
@click.option("--context", type=int, default=None, help="Cache capacity in tokens [default: the model's maximum].")
@click.option("--prefill-chunk", type=int, default=None, help="Prompt tokens per prefill step [default: target's].")
@click.option(
    "--weights",
    type=click.Choice(["fp32", "fp16", "fp8", "int8", "int4"]),
    default=None,
    help="Weight format [default: the target's].",
)
@click.option(
    "--block-size",
    type=click.Choice(["32", "64", "128"]),
    default="32",
    show_default=True,
    help="int4: input channels per scale.",
)
@click.option("--symmetric", is_flag=True, help="int4: no zero point.")
@click.option(
    "--accuracy-level",
    type=click.IntRange(0, 4),
    default=4,
    show_default=True,
    help="int4 on ONNX Runtime: 4 = int8 activations (fast), 1 = fp32 activations (exact).",
)
@kv_options
@click.option("--protect", default=None, help="Default protected tokens at run time: numbers,names.")
@click.option(
    "--embedding-bits",
    type=int,
    default=8,
    show_default=True,
    help="int4: bits of the embedding table (shared with a tied lm_head): 8 (exact for GGUF Q8_0) or 4 (smaller).",
)
@click.option(
    "--quant-method",
    default="rtn",
    show_default=True,
    help="int4: rtn (round to nearest), awq (activation-aware scaling) or gptq (error feedback); awq and gptq "
    "calibrate on text, a few minutes on CPU for 135M.",
)
@click.option("--calib", default=None, help="awq/gptq: calibration text file [default: Python's pydoc_data.topics].")
@click.option(
    "--int4-form",
    default=None,
    help="int4: matmulnbits (ONNX Runtime's kernel) or qdq (standard DequantizeLinear + MatMul) [default: target's].",
)
@click.option("--allow-pickle", is_flag=True, help="Accept pickle (*.bin) weights; pickle can run arbitrary code.")
@click.option("--overwrite", is_flag=True, help="Replace an existing bundle at -o.")
def build(
    model,
    target,
    output,
    context,
    prefill_chunk,
    weights,
    block_size,
    symmetric,
    accuracy_level,
    protect,
    embedding_bits,
    quant_method,
    calib,
    int4_form,
    allow_pickle,
    overwrite,
    **kv_flags,
) -> None:
    """Build a bundle from a Hugging Face folder or a .gguf file.

    \b
    Example:
      edgec build ./SmolLM2-135M-Instruct.Q4_1.gguf --target cpu -o smol.cpu.edgec --context 4096
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from edgec.build import STAGES, BuildSettings
    from edgec.build import build as run_build

    settings = BuildSettings(
        target=target,
        context=context,
        prefill_chunk=prefill_chunk,
        weights=weights,
        block_size=int(block_size),
        symmetric=symmetric,
        accuracy_level=accuracy_level,
        kv=Compression.from_flags({Compression.parameters()[key]: value for key, value in kv_flags.items()}),
        protect=protect,
        embedding_bits=embedding_bits,
        quant_method=quant_method,
        calib=calib,
        int4_form=int4_form,
        allow_pickle=allow_pickle,
        overwrite=overwrite,
    )
    columns = (
        TextColumn("{task.description:<10}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("starting", total=len(STAGES))

        steps: dict[str, int] = {}

        def advance(stage: str, done: int | None = None, total: int | None = None) -> None:
            if done is None:  # a stage starts
                progress.update(task, description=stage, completed=STAGES.index(stage))
                return
            if stage not in steps:  # a long stage's own bar (GPTQ: one step per layer)
                steps[stage] = progress.add_task(stage, total=total)
            progress.update(steps[stage], completed=done, total=total)

        result = run_build(model, output, settings, progress=advance)
        progress.update(task, description="done", completed=len(STAGES))
    validation = result.manifest["validation"]
    click.echo(
        f"wrote {output} (validation: top-1 agreement {validation['top1_agreement']:.0%}, "
        f"max |Δlogit| {validation['max_abs_logit_error']:.2e})"
    )
    click.echo("time: " + ", ".join(f"{stage[:-2]} {seconds:.1f} s" for stage, seconds in result.timings.items()))


@main.command()
def targets() -> None:
    """List the targets (one TOML file each in targets/).

    \b
    Example:
      edgec targets
    """
    from rich.console import Console
    from rich.table import Column, Table

    from edgec.targets import available_targets, load_target

    table = Table("device", "runtime", "sm", "memory", "usable", "dtypes", "build")
    table.columns.insert(0, Column("target", no_wrap=True))
    for name in available_targets():
        t = load_target(name)
        table.add_row(
            name,
            t.device,
            t.runtime,
            t.compute_capability or "",
            f"{t.memory_bytes / 2**30:.0f} GiB",
            f"{t.usable_bytes / 2**30:.1f} GiB",
            ",".join(t.dtypes),
            "yes" if t.buildable else "plan",
        )
    Console().print(table)


@main.command()
@click.argument("model")
@click.option("--target", "-t", default="cpu", show_default=True)
@click.option("--context", type=int, default=None, help="Context in tokens [default: the model's maximum].")
@click.option("--weights", type=click.Choice(["fp32", "fp16", "bf16", "fp8", "int8", "int4"]), default=None)
@click.option("--kv", type=click.Choice(["fp32", "fp16", "fp8", "int8", "int4"]), default=None)
@click.option("--prefill-chunk", type=int, default=None)
def plan(model, target, context, weights, kv, prefill_chunk) -> None:
    """Will MODEL fit TARGET, and with which settings? Needs only a config (no weights).

    MODEL is a model folder, a config.json, a .gguf, or a bundled config name (llama-2-7b, llama-3-8b,
    smollm2-135m). Settings you give are kept; the others are conceded in order until the plan fits.

    \b
    Example:
      edgec plan llama-3-8b --target rtx3060-laptop --context 16384
    """
    from rich.console import Console
    from rich.table import Table

    from edgec.plan import plan as make_plan

    shape, chosen = _plan_inputs(model, target, context, weights, kv, prefill_chunk)
    estimate = make_plan(shape, chosen[0], chosen[1], fixed=chosen[2])
    table = Table("", "", title=f"{shape.name} on {estimate.target.name}: fits")
    for key, value in estimate.table():
        table.add_row(key, value)
    console = Console()
    console.print(table)
    console.print(f"settings: {estimate.settings.describe()}")
    console.print(f"concessions made: {', '.join(estimate.concessions) or 'none'}")
    if shape.max_context and estimate.settings.context > shape.max_context:
        console.print(
            f"note: context {estimate.settings.context} is beyond the {shape.max_context} tokens "
            f"{shape.name} was trained for"
        )


def _plan_inputs(model, target_name, context, weights, kv, prefill_chunk):
    from edgec.errors import BuildSettingsError
    from edgec.plan import Settings, model_shape
    from edgec.targets import load_target

    target = load_target(target_name)
    shape = model_shape(model)
    for name, value in (("weights", weights), ("kv", kv)):
        if value is not None and value not in target.dtypes:
            raise BuildSettingsError(f"{target.name} has no {value} ({name}); it has {', '.join(target.dtypes)}")
    if context is not None and context < 1:
        raise BuildSettingsError(f"--context must be a positive number of tokens, got {context}")
    settings = Settings(
        weights=weights or target.defaults.get("weights", "fp32"),
        kv=kv or target.defaults.get("kv", "fp32"),
        context=context or shape.max_context or 4096,
        prefill_chunk=prefill_chunk or int(target.defaults.get("prefill_chunk", 512)),
    )
    fixed = frozenset(n for n, v in (("weights", weights), ("kv", kv), ("prefill_chunk", prefill_chunk)) if v)
    return shape, (target, settings, fixed)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--max-new-tokens", "-n", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat format.")
@click.option("--protect", default=None, help="Compressed cache: never evict these prompt tokens (numbers,names).")
@kv_options(at_load=True)
def run(bundle, prompt, max_new_tokens, temperature, top_k, top_p, seed, chat, protect, **kv_flags) -> None:
    """Generate text from a bundle, streaming to the terminal.

    \b
    Example:
      edgec run smol.cpu.edgec "Explain KV caches in one sentence." --chat
    """
    from edgec.runtime import Model

    model = Model.load(bundle, **kv_flags)
    pieces = model.generate(
        prompt,
        protect=protect,
        chat=chat,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stream=True,
    )
    for piece in pieces:
        click.echo(piece, nl=False)
    click.echo()


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def inspect(bundle) -> None:
    """Summarise a bundle: source, target, cache, op types, file sizes.

    \b
    Example:
      edgec inspect smol.cpu.edgec
    """
    from rich.console import Console
    from rich.table import Table

    from edgec.bundle import read_manifest, upgrade_manifest

    manifest = upgrade_manifest(read_manifest(bundle))
    console = Console()
    # build_settings is a record of the build (shown, never relied on); the rest is what the runtime reads
    source, cache, settings = manifest["source"], manifest["cache"], manifest["build_settings"]
    console.print(f"[bold]{bundle}[/bold]  format v{manifest['format_version']}, edgec {manifest['edgec_version']}")
    console.print(f"source: {source['name']} ({source['model_type']}, {source['kind']})")
    console.print(f"target: {manifest['target']['name']} ({manifest['target']['runtime']})")
    runtime = manifest["runtime"]
    if runtime.get("engine"):
        size = manifest["files"][runtime["engine"]]["size"]
        console.print(
            f"engine: {runtime['engine']} ({size / 2**20:,.1f} MiB), {runtime['library']} "
            f"{runtime['version']}, compute capability {runtime['compute_capability']}, "
            f"≤ {runtime['max_tokens_per_step']} tokens per step; rebuildable from {manifest['model']['file']}"
        )
    console.print(
        f"context: {manifest['model']['context']} tokens, prefill chunk {runtime['prefill_chunk']}, "
        f"weights {settings.get('weights', 'fp32')}"
    )
    if settings.get("weights") == "int4":
        console.print(
            f"int4: block {settings['block_size']}, {'symmetric' if settings['symmetric'] else 'zero point'}, "
            f"accuracy level {settings['accuracy_level']}, embedding {settings.get('embedding_bits', 8)} bits, "
            f"method {settings.get('quant_method', 'rtn')}, form {settings.get('int4_form') or 'the target default'}"
            + (f" (calibration text {settings['calib']})" if settings.get("calib") else "")
        )
    console.print(
        f"cache: {cache['dtype']}, {len(cache['layers'])} layers, {cache['bytes_per_token']:,} bytes/token, "
        f"{cache['total_bytes'] / 2**20:,.1f} MiB at full capacity"
    )
    if compression := cache.get("compression"):
        compressed = sum(1 for layer in cache["layers"] if layer.get("compressed"))
        console.print(
            f"compressed cache: {compressed} of {len(cache['layers'])} layers, {compression['capacity']} slots, "
            f"policy {compression['policy']}, {compression['dtype']} (group {compression['group']}), "
            f"sink {compression['sink']}, window {compression['window']}, prefill-compress "
            f"{compression['prefill_compress']}; k+v {cache['kv_bytes_per_token']:,.0f} bytes/token"
        )
    if cache.get("ring_kv_bytes"):
        rings = sum(1 for layer in cache["layers"] if layer.get("window") and not layer.get("compressed"))
        console.print(f"sliding-window rings: {rings} layers, {cache['ring_kv_bytes'] / 2**20:,.1f} MiB k+v (fixed)")
    validation = manifest["validation"]
    console.print(
        f"validation: top-1 agreement {validation['top1_agreement']:.0%}, "
        f"max |Δlogit| {validation['max_abs_logit_error']:.2e} on {validation['prompts']} prompts"
    )
    console.print(
        f"chat: {'yes' if manifest['tokenizer']['chat_format'] else 'no'} ({manifest['tokenizer']['chat_note']})"
    )
    ops = _op_histogram(Path(bundle) / manifest["model"]["file"])
    table = Table("op type", "count", title="graph ops (top level)")
    for op, count in ops.most_common():
        table.add_row(op, str(count))
    console.print(table)
    files = Table("file", "bytes", "sha256", title="files")
    for name, entry in manifest["files"].items():
        files.add_row(name, f"{entry['size']:,}", entry["sha256"][:16])
    console.print(files)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--compare", is_flag=True, help="Also run the bundle against its stored reference logits.")
def verify(bundle, compare) -> None:
    """Check a bundle: manifest, every file's sha256, the exact file set, the runtime library and GPU here.

    One line per check; exit code 1 when any check fails.

    \b
    Example:
      edgec verify smol.cpu.edgec --compare
    """
    from edgec.verify import verify as run_verify

    checks = run_verify(bundle, compare=compare)
    for check in checks:
        click.echo(check.line())
    failed = sum(check.status == "fail" for check in checks)
    click.echo(f"{failed} failed, {len(checks) - failed} passed or skipped" if failed else "bundle verified")
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Archive (.tar) to write.")
@click.option("--wheels", is_flag=True, help="Include the runtime's wheels and an offline install script.")
@click.option("--python", "python_version", default=None, help="Python of the target machine, e.g. 3.10.")
@click.option("--platform", default=None, help="pip platform tag of the target, e.g. manylinux2014_x86_64.")
def pack(bundle, output, wheels, python_version, platform) -> None:
    """Pack a bundle (and optionally the runtime's wheels) into one archive for an offline machine.

    \b
    Example:
      edgec pack smol.cpu.edgec -o smol.tar --wheels --python 3.10 --platform manylinux2014_x86_64
    """
    from edgec.pack import pack as run_pack

    run_pack(bundle, output, wheels=wheels, python=python_version, platform=platform)
    click.echo(f"wrote {output} ({output.stat().st_size / 2**20:,.1f} MiB)")


@main.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Folder to unpack into.")
def unpack(archive, output) -> None:
    """Unpack an archive made by `edgec pack`, checking every file of the bundle.

    \b
    Example:
      edgec unpack smol.tar -o deploy/ && sh deploy/install.sh
    """
    from edgec.pack import unpack as run_unpack

    bundle = run_unpack(archive, output)
    click.echo(f"unpacked {bundle} (every file's sha256 checked)")


def _op_histogram(model_path: Path) -> Counter:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return Counter(f"{node.domain}::{node.op_type}" if node.domain else node.op_type for node in model.graph.node)


if __name__ == "__main__":
    main()
