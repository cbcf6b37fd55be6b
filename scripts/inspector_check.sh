#!/usr/bin/env bash
# A third-party MCP client against `omskills serve`: the MCP Inspector CLI (npm, Node >= 20).
#
#   1. tools/list on the project's real skills;
#   2. tools/call of a tool scaffolded by `omskills new-skill` in a temporary skills folder
#      (so the call does not depend on which stage tools exist today);
#   3. the same tool with a task record outside the workspace: the server must refuse it,
#      which the Inspector reports with exit status 5 (tool error).
#
# Usage: scripts/inspector_check.sh   (from anywhere; uses the repo's .venv)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
omskills="$repo/.venv/bin/omskills"
python="$repo/.venv/bin/python"
inspector=(npx -y @modelcontextprotocol/inspector@2.12.0 --cli)
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT

echo "== tools/list (real skills)"
(cd "$repo" && "${inspector[@]}" "$omskills" serve --workspace . --method tools/list) > "$scratch/list.json"
"$python" - "$scratch/list.json" <<'PY'
import json, sys
tools = json.load(open(sys.argv[1]))["tools"]
for tool in tools:
    print(f"  {tool['name']:28s} {tool['description'].splitlines()[0][:80]}")
print(f"  {len(tools)} tool(s)")
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
echo "== ok: the Inspector listed the tools, called one, and saw the refusal"
