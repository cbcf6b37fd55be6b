"""Set-up as a new user meets it: the project's .mcp.json from the root and a subfolder, before
and after the install; `install-client` for Claude Code and Claude Desktop; `--version`;
`main-path` saying what it does from its first line."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from conftest import REPO, omskills
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from omskills.errors import InputError
from omskills.host.toolkit import skills_root
from omskills.orchestrator.skills_admin import desktop_config_path, install_client, parse_env_args

# --------------------------------------------------------------------------- helpers


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    """A fresh HOME: the client configuration files the tests write land there."""
    folder = tmp_path / "home"
    folder.mkdir()
    monkeypatch.setenv("HOME", str(folder))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    return folder


@pytest.fixture(scope="module")
def one_tool_skills(tmp_path_factory) -> Path:
    """A skills folder with one real, light tool: the server starts on it in a second."""
    skill = tmp_path_factory.mktemp("skills") / "drivers-only"
    (skill / "scripts").mkdir(parents=True)
    shutil.copy2(skills_root() / "om-deployer" / "scripts" / "list_drivers.py", skill / "scripts")
    (skill / "SKILL.md").write_text(
        "---\nname: drivers-only\ndescription: Lists model drivers. Tests only.\n---\n\nCall `list_drivers`.\n"
    )
    return skill.parent


def _mcp_json_server() -> dict:
    return json.loads((REPO / ".mcp.json").read_text())["mcpServers"]["omskills"]


async def _initialize_and_list(command: str, args: list[str], cwd: Path, env: dict[str, str]) -> tuple[str, list[str]]:
    """Start the server as a client would and answer (server name, tool names)."""
    params = StdioServerParameters(command=command, args=args, cwd=str(cwd), env=env)
    with anyio.fail_after(120), open(os.devnull, "w") as quiet:
        async with stdio_client(params, errlog=quiet) as (read, write), ClientSession(read, write) as session:
            result = await session.initialize()
            tools = await session.list_tools()
    return result.server_info.name, sorted(t.name for t in tools.tools)


def _serve(command: str, args: list[str], cwd: Path, skills: Path) -> tuple[str, list[str]]:
    env = {"OMSKILLS_SKILLS_DIR": str(skills)}  # the SDK adds PATH, HOME and the like
    return anyio.run(_initialize_and_list, command, args, cwd, env)


# --------------------------------------------------------------------------- the project's .mcp.json


def test_the_project_mcp_json_starts_the_server_from_the_root_and_from_a_subfolder(one_tool_skills):
    server = _mcp_json_server()
    # Claude Code starts stdio servers in the folder `claude` runs in: nothing may be relative to it.
    assert not server["command"].startswith(".") and "/" not in server["command"], server
    for cwd in (REPO, REPO / "tests"):
        name, tools = _serve(server["command"], server["args"], cwd, one_tool_skills)
        assert name == "omskills" and "list_drivers" in tools, (cwd, name, tools)


def test_before_the_install_the_launcher_says_what_to_do(tmp_path):
    clone = tmp_path / "fresh-clone"
    (clone / "scripts").mkdir(parents=True)
    (clone / "docs").mkdir()
    shutil.copy2(REPO / "scripts" / "omskills-mcp", clone / "scripts" / "omskills-mcp")
    server = _mcp_json_server()
    bare_path = os.pathsep.join(p for p in ("/usr/bin", "/bin") if not (Path(p) / "omskills").exists())
    result = subprocess.run(
        [server["command"], *server["args"]],
        cwd=clone / "docs",
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env={"PATH": bare_path, "HOME": str(tmp_path)},
        timeout=60,
    )
    assert result.returncode == 1 and result.stdout == ""  # stdout is the protocol's
    assert f"omskills is not installed: run `make install` in {clone}" in result.stderr, result.stderr


def test_the_project_mcp_json_copied_outside_a_checkout_says_what_to_run(tmp_path):
    server = _mcp_json_server()
    result = subprocess.run(
        [server["command"], *server["args"]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert result.returncode == 1 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert f"{tmp_path} is not inside one" in line and "omskills install-client claude-code" in line


# --------------------------------------------------------------------------- install-client


def _entry_paths_exist(entry: dict) -> None:
    command = Path(entry["command"])
    assert command.is_absolute() and command.is_file() and os.access(command, os.X_OK), entry
    workspace = entry["args"][entry["args"].index("--workspace") + 1]
    assert Path(workspace).is_absolute() and Path(workspace).is_dir(), entry


def test_install_client_desktop_merges_keeps_other_servers_and_refuses_to_clobber(home, tmp_path):
    config = desktop_config_path()
    assert config == home / ".config" / "Claude" / "claude_desktop_config.json"
    config.parent.mkdir(parents=True)
    other = {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-memory"]}
    config.write_text(json.dumps({"mcpServers": {"memory": other}, "globalShortcut": "Ctrl+Space"}))
    workspace = tmp_path / "work"
    workspace.mkdir()

    added = install_client("claude-desktop", workspace)
    data = json.loads(config.read_text())
    assert added.status == "added" and data["mcpServers"]["memory"] == other and data["globalShortcut"] == "Ctrl+Space"
    _entry_paths_exist(data["mcpServers"]["omskills"])
    assert data["mcpServers"]["omskills"]["args"][-1] == str(workspace.resolve())
    assert install_client("claude-desktop", workspace).status == "unchanged"

    # Someone else's omskills entry: shown as a diff, kept without --force, replaced with it.
    theirs = {**data["mcpServers"]["omskills"], "args": ["serve", "--workspace", "/elsewhere"]}
    data["mcpServers"]["omskills"] = theirs
    config.write_text(json.dumps(data))
    before = config.read_bytes()
    refused = install_client("claude-desktop", workspace)
    assert refused.status == "refused" and config.read_bytes() == before
    assert '-    "/elsewhere"' in refused.diff and f'+    "{workspace.resolve()}"' in refused.diff
    replaced = install_client("claude-desktop", workspace, force=True)
    data = json.loads(config.read_text())
    assert replaced.status == "replaced" and data["mcpServers"]["omskills"] == replaced.entry
    assert data["mcpServers"]["memory"] == other


def test_install_client_claude_code_user_and_project_scopes(home, tmp_path):
    user_config = home / ".claude.json"
    user_config.write_text(json.dumps({"numStartups": 3, "projects": {"/p": {"allowedTools": []}}, "mcpServers": {}}))
    user_config.chmod(0o600)
    here = tmp_path / "installed-from"
    here.mkdir()
    with contextlib.chdir(here):
        install_client("claude-code", scope="user")
    data = json.loads(user_config.read_text())
    assert data["numStartups"] == 3 and data["projects"] == {"/p": {"allowedTools": []}}
    assert stat.S_IMODE(user_config.stat().st_mode) == 0o600  # it holds the user's session data
    entry = data["mcpServers"]["omskills"]
    assert entry["type"] == "stdio" and Path(entry["command"]).is_absolute() and Path(entry["command"]).is_file()
    assert entry["args"][-2:] == ["--workspace", str(here.resolve())]  # absolute: the folder it was installed from

    project = tmp_path / "my-project"
    project.mkdir()
    result = install_client("claude-code", project)
    assert result.config_path == project.resolve() / ".mcp.json"
    _entry_paths_exist(json.loads(result.config_path.read_text())["mcpServers"]["omskills"])


def test_install_client_refuses_bad_input_without_writing(home, tmp_path):
    config = desktop_config_path()
    config.parent.mkdir(parents=True)
    config.write_text("{not json")
    with pytest.raises(InputError, match=f"{config}: cannot read it as JSON"):
        install_client("claude-desktop", tmp_path)
    assert config.read_text() == "{not json"
    with pytest.raises(InputError, match="--workspace: .* is not a folder"):
        install_client("claude-code", tmp_path / "missing")
    with pytest.raises(InputError, match="--scope applies to claude-code only"):
        install_client("claude-desktop", tmp_path, "user")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ('{"mcpServers": {"a": {"command": "x"}}, "mcpServers": {}}', "the key 'mcpServers' is given twice"),
        ('{"zoom": 1e400, "mcpServers": {}}', "beyond what JSON can write back"),
        ('{"zoom": NaN}', "NaN is not JSON"),
        ('{"name": "\\ud800"}', "surrogate"),
        ("[" * 100_000 + "]" * 100_000, "cannot read it as JSON"),
    ],
)
def test_a_config_a_rewrite_could_not_keep_is_refused_with_nothing_written(home, tmp_path, text, why):
    config = desktop_config_path()
    config.parent.mkdir(parents=True)
    config.write_text(text)
    with pytest.raises(InputError, match=why):
        install_client("claude-desktop", tmp_path)
    assert config.read_text() == text


def test_a_config_that_is_a_symlink_is_written_only_when_asked_and_keeps_its_link(home, tmp_path):
    dotfiles = tmp_path / "dotfiles" / "claude.json"
    dotfiles.parent.mkdir()
    dotfiles.write_text(json.dumps({"numStartups": 3}))
    (home / ".claude.json").symlink_to(dotfiles)
    with pytest.raises(InputError, match="is a symbolic link .*--follow-link"):
        install_client("claude-code", tmp_path, "user")
    assert json.loads(dotfiles.read_text()) == {"numStartups": 3}
    install_client("claude-code", tmp_path, "user", follow_link=True)
    assert (home / ".claude.json").is_symlink() and "omskills" in json.loads(dotfiles.read_text())["mcpServers"]


def test_the_written_desktop_entry_starts_the_server_from_the_root_folder(home, tmp_path, one_tool_skills):
    # Claude Desktop starts servers in `/`.
    workspace = tmp_path / "work"
    workspace.mkdir()
    entry = install_client("claude-desktop", workspace).entry
    name, tools = _serve(entry["command"], entry["args"], Path("/"), one_tool_skills)
    assert name == "omskills" and "list_drivers" in tools


def test_install_client_cli_exits_non_zero_naming_force(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("XDG_CONFIG_HOME", None)
    first = omskills("install-client", "claude-desktop", "--workspace", str(tmp_path), env=env)
    lines = first.stdout.splitlines()
    assert first.returncode == 0 and lines[-3].startswith("added: mcpServers.omskills in "), first.stderr
    assert lines[-2].startswith(f"workspace: {tmp_path.resolve()} ")  # said, absolute
    again = omskills("install-client", "claude-desktop", "--workspace", str(REPO), env=env)
    assert again.returncode == 1 and "rerun with --force" in again.stderr and f'+    "{REPO}"' in again.stdout


def test_install_client_env_writes_the_servers_settings_into_the_entry(tmp_path):
    """`--env KEY=VALUE` (repeatable) is how the server gets its settings from a client, which starts it
    with the entry's `env`: each one checked, then written; a setting set in the shell but not passed is
    named on stderr, since the server will not see it."""
    home, workspace, inputs, checkout = (tmp_path / name for name in ("home", "work", "inputs", "sam31"))
    for folder in (home, workspace, inputs, checkout):
        folder.mkdir()
    shell = {key: value for key, value in os.environ.items() if not key.startswith("OMSKILLS_")}
    env = {**shell, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg"), "OMSKILLS_HEARTBEAT_SECONDS": "5"}
    installed = omskills(
        "install-client",
        "claude-desktop",
        "--workspace",
        str(workspace),
        "--env",
        f"OMSKILLS_INPUT_ROOTS={inputs}{os.pathsep}{checkout}",
        "--env",
        "OMSKILLS_LOG_LEVEL=debug",
        "--env",
        f"OMSKILLS_SAM31_SOURCE={checkout}",
        env=env,
    )
    assert installed.returncode == 0, installed.stderr
    config = home / "xdg" / "Claude" / "claude_desktop_config.json"
    assert json.loads(config.read_text())["mcpServers"]["omskills"]["env"] == {
        "OMSKILLS_INPUT_ROOTS": f"{inputs}{os.pathsep}{checkout}",
        "OMSKILLS_LOG_LEVEL": "DEBUG",
        "OMSKILLS_SAM31_SOURCE": str(checkout),
    }
    assert '+    "OMSKILLS_LOG_LEVEL": "DEBUG",' in installed.stdout  # in the diff it shows
    assert installed.stderr.splitlines() == [
        "omskills: note: OMSKILLS_HEARTBEAT_SECONDS is set here but not written, so the server will not see "
        'it: add --env OMSKILLS_HEARTBEAT_SECONDS="$OMSKILLS_HEARTBEAT_SECONDS" to give it'
    ]


@pytest.mark.parametrize(
    ("setting", "why"),
    [
        ("OMSKILLS_INPUT_ROOTS=relative/inputs", "'relative/inputs' is not an absolute path"),
        ("OMSKILLS_INPUT_ROOTS={missing}", "{missing} is not an existing folder"),
        ("OMSKILLS_INPUT_ROOTS={inputs}:{missing}", "{missing} is not an existing folder"),
        ("OMSKILLS_INPUT_ROOTS=:", "names no folder"),
        ("OMSKILLS_SAM31_SOURCE={inputs}\nrm -rf ~", "the value is empty or holds a control character"),
        ("OMSKILLS_LOG_LEVEL=chatty", "OMSKILLS_LOG_LEVEL='CHATTY': expected DEBUG"),
        ("OMSKILLS_HEARTBEAT_SECONDS=inf", "expected a positive number of seconds"),
        ("OMSKILLS_PARENT_PID=1", "not a setting the server reads; it takes OMSKILLS_INPUT_ROOTS"),
        ("ANTHROPIC_API_KEY=sk-secret", "not a setting the server reads"),
        ("OMSKILLS_LOG_LEVEL", "expected KEY=VALUE"),
    ],
)
def test_install_client_env_refuses_a_setting_it_cannot_vouch_for_and_writes_nothing(home, tmp_path, setting, why):
    inputs, missing = tmp_path / "inputs", tmp_path / "missing"
    inputs.mkdir()
    given = setting.format(inputs=inputs, missing=missing)
    with pytest.raises(InputError, match=re.escape(why.format(missing=missing))):
        install_client("claude-desktop", tmp_path, env=parse_env_args([given]))
    assert not desktop_config_path().exists()


def test_install_client_env_refused_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("XDG_CONFIG_HOME", None)
    refused = omskills("install-client", "claude-desktop", "--env", "OMSKILLS_INPUT_ROOTS=inputs", env=env)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        "omskills: error: --env OMSKILLS_INPUT_ROOTS: 'inputs' is not an absolute path (the client starts the "
        "server elsewhere)"
    ]
    twice = omskills(
        "install-client",
        "claude-desktop",
        "--env",
        "OMSKILLS_LOG_LEVEL=INFO",
        "--env",
        "OMSKILLS_LOG_LEVEL=DEBUG",
        env=env,
    )
    assert twice.returncode == 2 and "--env OMSKILLS_LOG_LEVEL: given twice" in twice.stderr
    assert not (tmp_path / ".config").exists()


# --------------------------------------------------------------------------- --version, main-path


def test_version_comes_from_the_package_metadata_without_heavy_imports():
    probe = (
        "import sys; from omskills.orchestrator.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit as done:\n    code = done.code\n"
        "print('heavy:', sorted(m for m in ('torch', 'numpy', 'mcp', 'onnx', 'anthropic') if m in sys.modules), code)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.stdout.splitlines() == [f"omskills {importlib.metadata.version('omskills')}", "heavy: [] 0"], (
        result.stderr
    )


def test_main_path_says_what_it_does_from_its_first_line(tmp_path):
    (tmp_path / "net_driver.py").write_text(
        textwrap.dedent("""
        import torch

        def build_model(spec):
            return torch.nn.Linear(4, 4)

        def run_main_path(model, inputs):
            return {"scores": model(torch.ones(1, 4))}
    """)
    )
    (tmp_path / "task.yaml").write_text("id: phase-lines\nintake:\n  model:\n    driver: net_driver.py\n")
    # Note whether torch was imported when the first phase line came out.
    probe = (
        "import sys\nfrom omskills.orchestrator import job_commands\nshow = job_commands.PhaseLines.__call__\n"
        "def spy(self, done, total, message):\n"
        "    if not hasattr(spy, 'said'):\n"
        "        spy.said = print('torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
        "    show(self, done, total, message)\n"
        "job_commands.PhaseLines.__call__ = spy\n"
        "from omskills.orchestrator.cli import main\nsys.exit(main())"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, "main-path", "task.yaml", "--out", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "torch imported: False"
    phases = [line.split("] ", 1)[1] for line in lines if line.startswith("[")]
    assert phases[0] == "reading task.yaml and loading its model driver..."
    # Then the model's own phases (inputs, build: open_model reports them), then the main path's, last.
    tail = phases[phases.index("running the main path: setup and step 1...") :]
    assert tail[:2] == ["running the main path: setup and step 1...", "running the main path: step 1 done"], phases
    assert len(tail) == 3 and tail[2].startswith("main path done (1 step(s) in "), phases
    assert tail[2].endswith("); writing outputs and pictures to out..."), phases
    assert (tmp_path / "out" / "main_path.json").is_file()
