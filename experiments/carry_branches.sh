#!/usr/bin/env bash
# Branches' trees as carried folders, so that one device call tests several of them: each BRANCH's gluon_attn/,
# tests/ and pyproject.toml (and experiments/ with --experiments) into .carry/br-NAME (NAME: the branch less
# "next/"), ~1.4 MiB each (1.7 with experiments/). The working tree (~8 MiB) and .carry/triton39 (55 MiB) leave ~1 MiB
# of a call's 64, so they travel in the call after the one that stashed Triton, on the still warm machine (/tmp kept):
# (cd .carry/br-NAME && PYTHONPATH=/tmp/triton:. python3 -m pytest -m gpu tests/...).
# Usage: experiments/carry_branches.sh [--experiments] BRANCH...
set -euo pipefail
cd "$(dirname "$0")/.."
paths=(gluon_attn tests pyproject.toml)
if [ "${1:-}" = "--experiments" ]; then paths+=(experiments); shift; fi
for branch in "$@"; do
  name=br-${branch#next/}
  rm -rf ".carry/$name" && mkdir -p ".carry/$name"
  git archive "$branch" "${paths[@]}" | tar -x -C ".carry/$name"
  rm -f ".carry/$name/experiments/NOTES.md"
  echo "$(du -sh ".carry/$name" | cut -f1)	.carry/$name	$(git rev-parse --short "$branch")"
done
