#!/usr/bin/env bash
# A third-party MCP client against `omskills serve`: the MCP Inspector CLI (npm, Node >= 20).
#
#   1. connect time: how long `omskills serve` takes to answer `initialize` and `tools/list`
#      (measured with the SDK's stdio client, median of 5; the bar is omskills' own time: at most
#      1 s more than a one-tool server of the same SDK measured in the same run, so a loaded
#      machine slows both alike; the absolute time is printed beside it), and the
#      Inspector's own wall time for tools/list against omskills and against a one-tool server
#      (the difference is what our server adds);
#   2. tools/list on the project's real skills: every tool has a title and annotations;
#   3. resources/list, resources/templates/list and prompts/list (with descriptions),
#      prompts/get of adapt_task;
#   4. tools/call of a tool scaffolded by `omskills new-skill` in a temporary skills folder
#      (so the call does not depend on which stage tools exist today), directly, then as a job
#      started in one Inspector invocation and read with job_status in the next (each
#      invocation starts and ends a server of its own: the job outlives the first);
#   5. the same tool with a task record outside the workspace: the server must refuse it,
#      which the Inspector reports with exit status 5 (tool error);
#   6. `omskills chat` in a tmux terminal against the suite's stand-in for the Messages API:
#      Ctrl-C while a tool runs (the tool is cancelled, the chat goes on), a new question, and
#      Ctrl-C at the prompt (the chat quits).
#
# Usage: scripts/inspector_check.sh   (from anywhere; uses the repo's .venv)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
omskills="$repo/.venv/bin/omskills"
python="$repo/.venv/bin/python"
inspector=(npx -y @modelcontextprotocol/inspector@2.12.0 --cli)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

now() { "$python" -c 'import time; print(time.monotonic())'; }

echo "== connect time (omskills serve --workspace $repo, beside a one-tool server of the same SDK)"
cat > "$scratch/one_tool_server.py" <<'PY'
from mcp.server.mcpserver import MCPServer

server = MCPServer("baseline")


@server.tool()
def ping() -> str:
    """Answer pong."""
    return "pong"


server.run("stdio")
PY
set +e
"$python" - "$omskills" "$repo" "$python" "$scratch/one_tool_server.py" <<'PY'
import statistics, sys, time
import anyio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

omskills, workspace, python, baseline = sys.argv[1:5]

async def once(command: str, args: list[str]) -> tuple[float, float]:
    params = StdioServerParameters(command=command, args=args, cwd=workspace)
    started = time.monotonic()
    with open("/dev/null", "w") as quiet:
        async with stdio_client(params, errlog=quiet) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                initialized = time.monotonic() - started
                await session.list_tools()
                return initialized, time.monotonic() - started

runs, bare = [], []
for _ in range(5):  # interleaved: the machine's load falls on both alike
    runs.append(anyio.run(once, omskills, ["serve", "--workspace", workspace]))
    bare.append(anyio.run(once, python, [baseline]))
init = statistics.median(r[0] for r in runs)
listed = statistics.median(r[1] for r in runs)
base = statistics.median(r[0] for r in bare)
print(f"  initialize answered after {init:.2f} s, tools/list after {listed:.2f} s "
      f"(median of 5; runs: {', '.join(f'{a:.2f}/{b:.2f}' for a, b in runs)})")
print(f"  a one-tool server of the same SDK: initialize after {base:.2f} s; omskills' own time {init - base:.2f} s "
      f"(bar 1.0 s): {'ok' if init - base <= 1.0 else 'OVER'}")
sys.exit(0 if init - base <= 1.0 else 3)
PY
connect_status=$?
set -e

t0=$(now)
"${inspector[@]}" "$python" "$scratch/one_tool_server.py" --method tools/list > /dev/null
t1=$(now)
(cd "$repo" && "${inspector[@]}" "$omskills" serve --workspace . --method tools/list) > "$scratch/list.json"
t2=$(now)
"$python" -c "import sys; a,b,c = map(float, sys.argv[1:]); print(f'  Inspector tools/list wall time: omskills {c-b:.2f} s, one-tool server {b-a:.2f} s (node + npx + Python start): omskills adds {c-b-(b-a):.2f} s')" "$t0" "$t1" "$t2"

echo "== tools/list (real skills)"
"$python" - "$scratch/list.json" <<'PY'
import json, sys
tools = json.load(open(sys.argv[1]))["tools"]
for tool in tools:
    hints = tool.get("annotations") or {}
    flags = "".join(flag for flag, key in (("R", "readOnlyHint"), ("D", "destructiveHint"), ("I", "idempotentHint")) if hints.get(key))
    print(f"  {tool['name']:24s} {flags:3s} {(tool.get('title') or '-')[:40]:40s} {tool['description'].splitlines()[0][:60]}")
missing = [t["name"] for t in tools if not t.get("title") or not t.get("annotations")]
print(f"  {len(tools)} tool(s) (R read-only, D destructive, I idempotent); without title or annotations: {missing or 'none'}")
PY

echo "== resources/list, resources/templates/list, prompts/list (real skills, workspace = repo)"
(cd "$repo" && "${inspector[@]}" "$omskills" serve --workspace . --method resources/list) > "$scratch/resources.json"
(cd "$repo" && "${inspector[@]}" "$omskills" serve --workspace . --method resources/templates/list) > "$scratch/templates.json"
(cd "$repo" && "${inspector[@]}" "$omskills" serve --workspace . --method prompts/list) > "$scratch/prompts.json"
(cd "$repo" && "${inspector[@]}" "$omskills" serve --workspace . --method prompts/get --prompt-name adapt_task \
  --prompt-args task=task_records/sam3-video-text.yaml) > "$scratch/prompt.json"
"$python" - "$scratch" <<'PY'
import json, sys
from pathlib import Path
scratch = Path(sys.argv[1])
resources = json.loads((scratch / "resources.json").read_text())["resources"]
for r in resources[:12]:
    print(f"  {r['uri']:58s} {r.get('mimeType', '-'):16s} {(r.get('description') or '')[:60]}")
undescribed = [r["uri"] for r in resources if not r.get("description")]
print(f"  {len(resources)} resource(s); without a description: {undescribed or 'none'}")
templates = json.loads((scratch / "templates.json").read_text())["resourceTemplates"]
for t in templates:
    print(f"  {t['uriTemplate']:32s} {t.get('mimeType', '-'):20s} {(t.get('description') or '')[:60]}")
prompts = json.loads((scratch / "prompts.json").read_text())["prompts"]
for p in prompts:
    args = ", ".join(a["name"] for a in p.get("arguments", []))
    print(f"  prompt {p['name']} ({args}): {p.get('title')}")
text = json.loads((scratch / "prompt.json").read_text())["messages"][0]["content"]["text"]
print(f"  prompts/get adapt_task: {text.splitlines()[0]}")
assert resources and templates and len(prompts) >= 2 and not undescribed
PY

echo "== tools/call (scaffolded skill)"
mkdir -p "$scratch/ws" "$scratch/elsewhere"
"$omskills" new-skill inspector-demo --skills-dir "$scratch/skills" > /dev/null
"$python" - "$scratch/ws/task.yaml" "$scratch/elsewhere/task.yaml" <<'PY'
import sys, yaml
record = {"id": "inspector", "intake": {"model": {"family": "sam3", "builder": "sam3.model_builder:build_sam3_video_model"},
                                        "inputs": {"video": "builtin:demo", "prompt": "a cat"}}}
for path in sys.argv[1:]:
    open(path, "w").write(yaml.safe_dump(record))
PY
serve=("$omskills" serve --workspace "$scratch/ws" --skills-dir "$scratch/skills")
"${inspector[@]}" "${serve[@]}" --method tools/call --tool-name inspector_demo_task_summary --tool-arg task=task.yaml \
  | tee "$scratch/call.json"
grep -q '"task_id": "inspector"' "$scratch/call.json"

echo "== a job across two Inspector invocations (each starts a server of its own, which ends with it)"
"${inspector[@]}" "${serve[@]}" --method tools/call --tool-name start_job \
  --tool-args-json '{"tool": "inspector_demo_task_summary", "arguments": {"task": "task.yaml"}}' | tee "$scratch/job.json"
job_id="$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1]))["structuredContent"]["job_id"])' "$scratch/job.json")"
"${inspector[@]}" "${serve[@]}" --method tools/call --tool-name job_status \
  --tool-args-json "{\"job_id\": \"$job_id\", \"wait_seconds\": 30}" | tee "$scratch/status.json"
grep -q '"state": "succeeded"' "$scratch/status.json"
grep -q '"task_id": "inspector"' "$scratch/status.json"

echo "== tools/call with a path outside the workspace (must be refused)"
set +e
"${inspector[@]}" "${serve[@]}" --method tools/call --tool-name inspector_demo_task_summary \
  --tool-arg task="$scratch/elsewhere/task.yaml" > "$scratch/refused.json" 2>&1
status=$?
set -e
cat "$scratch/refused.json"
if [[ $status -ne 5 ]] || ! grep -q "outside the workspace" "$scratch/refused.json"; then
  echo "FAILED: expected exit 5 and 'outside the workspace', got exit $status" >&2
  exit 1
fi
echo "== omskills chat in a terminal (tmux): Ctrl-C during a tool, a new question, Ctrl-C at the prompt"
"$python" - "$repo" "$omskills" "$scratch/chat" <<'PY'
import subprocess, sys, time
from pathlib import Path

repo, omskills, folder = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
sys.path.insert(0, str(repo / "tests"))
from fake_anthropic import calls, done, fake_anthropic, tool_use  # the suite's stand-in for the Messages API
from mcp_helpers import write_task_record, write_toy_skill
from omskills.records.task import load_record

write_toy_skill(folder / "skills")
task = write_task_record(folder / "ws" / "toy" / "task.yaml").resolve()
session = "omskills-chat-check"

def pane() -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session, "-S", "-200"], capture_output=True, text=True).stdout

def wait_for(what, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not what():
        if time.monotonic() > deadline:
            sys.exit(f"FAILED: timed out; the terminal shows:\n{pane()}")
        time.sleep(0.2)

script = [calls(tool_use("toy_stage", {"task": str(task), "seconds": 120})), done("fine, it stopped.")]
with fake_anthropic(script) as api:
    env = [f"{k}={v}" for k, v in {"ANTHROPIC_API_KEY": "check", "ANTHROPIC_BASE_URL": api.base_url,
                                    "OMSKILLS_SKILLS_DIR": str(folder / "skills")}.items()]
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "160", "-y", "50", "env", *env,
                    omskills, "chat", "--task", str(task), "--workspace", str(folder / "ws")], check=True)
    try:
        wait_for(lambda: "you>" in pane())
        subprocess.run(["tmux", "send-keys", "-t", session, "stage it", "Enter"], check=True)
        wait_for(lambda: (s := load_record(task).stages.get("toy_stage")) is not None and s.status == "running")
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        wait_for(lambda: "(cancelled; type again to go on)" in pane())
        # the server stops the tool at its next progress point, just after the chat is back at the prompt
        wait_for(lambda: load_record(task).stages["toy_stage"].status != "running", 10)
        step = load_record(task).stages["toy_stage"]
        print(f"  Ctrl-C during toy_stage: the chat goes on; the step is {step.status}: {step.error}")
        subprocess.run(["tmux", "send-keys", "-t", session, "why?", "Enter"], check=True)
        wait_for(lambda: "claude> fine, it stopped." in pane())
        print("  a new question after it: answered")
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        wait_for(lambda: subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0, 10)
        print("  Ctrl-C at the prompt: the chat quit")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
assert step.status == "failed" and "cancelled" in (step.error or "")
PY

if [[ $connect_status -ne 0 ]]; then
  echo "FAILED: omskills took over 1 s more than a one-tool server to answer initialize (see above)" >&2
  exit 1
fi
echo "== ok: the Inspector listed tools, resources and prompts, called a tool directly and as a job across two servers, and saw the refusal; the chat survived a Ctrl-C in a terminal"
