"""``batchgen serve``: OpenAI's Batch API (Files + Batches) on this machine (``pipeline.serve``).

``batchgen.cli`` adds ``commands`` to the ``batchgen`` group."""
from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

import click
import yaml

from pipeline.run.history import resolve_state_dir

EXIT_USER_ERROR = 2


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _config(path: str | None, models: tuple[str, ...]):
    from pipeline.serve.worker import ServeConfig
    doc = {}
    if path:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise click.BadParameter(f"{path}: {e}", param_hint="--config") from None
        if not isinstance(doc, dict):
            raise click.BadParameter(f"{path}: expected a mapping", param_hint="--config")
        unknown = set(doc) - {"models", "default_model", "generation", "commit_every_s"}
        if unknown:
            raise click.BadParameter(f"{path}: unknown key(s) {', '.join(sorted(unknown))}", param_hint="--config")
    served = {}
    for alias, spec in (doc.get("models") or {}).items():
        spec = {"model": spec} if isinstance(spec, str) else spec
        if not isinstance(spec, dict) or not isinstance(spec.get("model"), str):
            raise click.BadParameter(f"{path}: models.{alias} needs a model (a name, HF dir or .gguf)",
                                     param_hint="--config")
        served[str(alias)] = {"model": spec["model"], "engine": spec.get("engine") or {}}
    for m in models:
        alias, _, spec = m.partition("=")
        served[alias] = {"model": spec or alias, "engine": {}}
    cfg = ServeConfig()
    if served:
        cfg.models = served
    if doc.get("default_model"):
        if doc["default_model"] not in cfg.models:
            raise click.BadParameter(f"{path}: default_model {doc['default_model']!r} is not one of models",
                                     param_hint="--config")
        cfg.default_model = doc["default_model"]
    cfg.generation.update(doc.get("generation") or {})
    if "commit_every_s" in doc:
        cfg.commit_every_s = float(doc["commit_every_s"])
    if os.environ.get("BATCHGEN_SERVE_WINDOW_S"):            # tests: expiry in seconds, not a day
        cfg.window_s = float(os.environ["BATCHGEN_SERVE_WINDOW_S"])
    return cfg


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True), default=None,
              help="A file of API keys, one a line; clients send one as `Authorization: Bearer KEY`.")
@click.option("--no-auth", is_flag=True, help="No API key (only on a loopback host).")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Files, batches and their runs (default: the state dir's serve/).")
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True), default=None,
              help="YAML: models (alias: model spec, or {model, engine}), default_model, generation defaults.")
@click.option("--model", "models", multiple=True, metavar="[ALIAS=]MODEL",
              help="A model this server may run (repeatable; default gemma-3-270m).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Compute the batches on Ray engine replicas (as `batchgen submit --ray`): ADDRESS (or "
                   "$RAY_ADDRESS) of a cluster, else a local Ray instance. Needs the ray extra.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="With --ray: engine replicas (default: 1 locally, one per alive node on a cluster).")
def serve(host, port, api_key_file, no_auth, data_dir, config_path, models, ray_address, replicas):
    """Serve OpenAI's Batch API (Files + Batches): point the `openai` client's base_url here.

    Each batch is a batchgen run (the planner, the engine, the prefix cache across the batches queued together);
    state survives a restart: a killed server resumes its batches where their committed rows end."""
    if no_auth and not _loopback(host):
        click.echo("batchgen: --no-auth only on a loopback host (127.0.0.1, ::1, localhost)", err=True)
        sys.exit(EXIT_USER_ERROR)
    keys = None
    if not no_auth:
        if api_key_file is None:
            click.echo("batchgen: an API key is required: --api-key-file FILE (one key a line), or --no-auth on a "
                       "loopback host", err=True)
            sys.exit(EXIT_USER_ERROR)
        keys = [k.strip() for k in Path(api_key_file).read_text().splitlines() if k.strip()]
        if not keys:
            click.echo(f"batchgen: {api_key_file} holds no key", err=True)
            sys.exit(EXIT_USER_ERROR)
    try:
        import uvicorn

        from pipeline.serve.app import create_app
        from pipeline.serve.store import Store
        from pipeline.serve.worker import Worker
    except ModuleNotFoundError as e:
        click.echo(f"batchgen: serve needs {e.name}: pip install -e '.[serve]'", err=True)
        sys.exit(EXIT_USER_ERROR)
    cfg = _config(config_path, models)
    if ray_address is not None:
        from pipeline.execute.ray.driver import RayMissing, import_ray
        try:
            import_ray()                         # without Ray: how to get it, exit 2, before serving anything
        except RayMissing as e:
            click.echo(f"batchgen: {e}", err=True)
            sys.exit(EXIT_USER_ERROR)
        cfg.ray_address, cfg.replicas = ray_address, replicas
    elif replicas is not None:
        raise click.BadParameter("needs --ray", param_hint="--replicas")
    store = Store(data_dir or resolve_state_dir(None) / "serve")
    worker = Worker(store, cfg)
    app = create_app(store, keys, window_s=cfg.window_s)
    worker.start()
    click.echo(f"batchgen serve: http://{host}:{port}/v1 (data in {store.dir}; models: {', '.join(cfg.models)})",
               err=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        worker.stop()


commands = [serve]
