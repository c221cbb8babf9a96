#!/bin/bash
# usage: run.sh NAME  (from a tree given as $TREE, default worktree)
NAME=$1
TREE=${TREE:-/work/wt/tail}
cd $TREE
flock /tmp/lmcache_p2p_vllm.lock bash -c "echo lock_acquired \$(date -u +%T) load \$(cut -d' ' -f1-3 /proc/loadavg); PYTHONPATH=$TREE timeout 1500 /work/main/.venv/bin/python bench/anchor.py --systems lmcache_p2p,lmcache-pd --concurrency 4 --rates '' --anchor /work/shared/anchor --work /work/wt/tail/runs/anchor --log-dir /work/wt/tail/logs/$NAME --out /tmp/tail/$NAME.json"
echo done rc=$? $(date -u +%T)
