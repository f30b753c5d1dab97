"""Secrets stay out of logs and non-0600 files; the API binds where agents reach it; the
``api`` config section's bounds."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import pytest

from orchestrator.config.schema import Config
from orchestrator.logs import configure_logging, get_logger, redact
from orchestrator.contracts.rundir import RunDir
from orchestrator.supervisor.gateway.server import bind_host, server_ssl_context

TOKEN = "tok-" + "x7Yq" * 10


def test_a_registered_secret_is_masked_everywhere(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    log_file = tmp_path / "supervisor.log"
    configure_logging(log_file, console=True)  # after capsys took stderr: the console sink
    try:
        redact(TOKEN)
        log = get_logger("orchestrator.test")
        log.info(f"header was Bearer {TOKEN}", extra_field=f"x{TOKEN}y",
                 nested={"a": [TOKEN]})
        # A foreign library's line, as aiohttp logs a bad request's first bytes.
        logging.getLogger("aiohttp.server").error("bad request: %r", f"Authorization: {TOKEN}")

        def handler(headers: dict[str, str]) -> None:
            authorization = headers["Authorization"]  # a local a rich traceback would print
            raise RuntimeError(f"failed with {authorization}")

        try:
            handler({"Authorization": f"Bearer {TOKEN}"})
        except RuntimeError:
            log.exception("api handler failed")
        written = log_file.read_text()
        console = capsys.readouterr().err
    finally:
        for h in list(logging.getLogger().handlers):
            h.close()
            logging.getLogger().removeHandler(h)
    for text in (written, console):
        assert TOKEN not in text
        assert "***" in text
        assert "RuntimeError" in text  # the traceback is there, with the secret masked
    assert "authorization = " not in console  # no locals in the console's traceback


def test_token_and_credential_files_are_0600(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    token = run.ensure_token()
    assert stat.S_IMODE(run.token_file.stat().st_mode) == 0o600
    assert run.ensure_token() == token
    run.token_file.chmod(0o644)  # an older version's, or a copy's
    assert run.ensure_token() == token
    assert stat.S_IMODE(run.token_file.stat().st_mode) == 0o600
    run.write_secret(run.credentials / "slurm-0", "orch-node-v1.slurm-0.abc")
    assert stat.S_IMODE((run.credentials / "slurm-0").stat().st_mode) == 0o600
    assert stat.S_IMODE(run.credentials.stat().st_mode) == 0o700
    assert (run.credentials / "slurm-0").read_text() == "orch-node-v1.slurm-0.abc"
    assert not list(run.credentials.glob("*.tmp"))


def test_the_api_binds_where_agents_reach_it() -> None:
    local = Config.model_validate({"launcher": {"kind": "local"}})
    assert bind_host(local) == "127.0.0.1"
    remote = Config.model_validate({"launcher": {"kind": "ssh", "ssh": {"hosts": ["a"]}}})
    assert bind_host(remote) == "0.0.0.0"
    explicit = Config.model_validate({"launcher": {"kind": "local"},
                                      "metrics": {"host": "10.1.2.3"}})
    assert bind_host(explicit) == "10.1.2.3"
    assert server_ssl_context(local) is None


def test_api_section_bounds_and_tls_pair() -> None:
    cfg = Config.model_validate({})
    assert cfg.api.max_body_mb == 32 and cfg.api.max_json_depth == 32
    assert cfg.api.header_timeout_s > 0 and cfg.api.max_nodes >= 1
    for bad in ({"max_json_depth": 500}, {"max_body_mb": 0}, {"tls_cert": "c.pem"},
                {"max_step_interval_s": 1e15}, {"unknown": 1}):
        with pytest.raises(ValueError):
            Config.model_validate({"api": bad})
