#!/usr/bin/env bash
# Branches' trees as carried folders, so that one device call tests several of them: each BRANCH's gluon_attn/,
# tests/ and pyproject.toml (and experiments/ with --experiments) into .carry/br-NAME (NAME: the branch less
# "next/"), ~1.4 MiB each (1.7 with experiments/). `--tests 'PYTEST ARGS'` before a branch writes them to that
# folder's GPU_TESTS, which `gpu_run.sh branches` runs (pytest -m gpu -x ARGS, in the folder). The working tree
# (~8 MiB) and .carry/triton39 (55 MiB) leave ~1 MiB of a call's 64, so the folders travel in the call after the one
# that stashed Triton, on the still warm machine (/tmp kept): `gpu_run.sh triton branches -- $OUT`.
# Usage: experiments/carry_branches.sh [--experiments] [--tests 'ARGS'] BRANCH [[--tests 'ARGS'] BRANCH]...
set -euo pipefail
cd "$(dirname "$0")/.."
paths=(gluon_attn tests pyproject.toml)
if [ "${1:-}" = "--experiments" ]; then paths+=(experiments); shift; fi
tests=
while [ $# -gt 0 ]; do
  if [ "$1" = "--tests" ]; then tests=$2; shift 2; continue; fi
  branch=$1; shift
  name=br-${branch#next/}
  rm -rf ".carry/$name" && mkdir -p ".carry/$name"
  git archive "$branch" "${paths[@]}" | tar -x -C ".carry/$name"
  rm -f ".carry/$name/experiments/NOTES.md"
  [ -z "$tests" ] || printf '%s\n' "$tests" > ".carry/$name/GPU_TESTS"
  echo "$(du -sh ".carry/$name" | cut -f1)	.carry/$name	$(git rev-parse --short "$branch")	${tests:-(no GPU_TESTS)}"
  tests=
done
