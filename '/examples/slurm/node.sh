#!/usr/bin/env bash
# One node's share of a multi-node labkit run: start torchrun, which starts this node's ranks and joins the
# other nodes (static rendezvous on MASTER_ADDR:MASTER_PORT, hosted by node 0's torchrun).
#
# Under Slurm, srun starts one copy per node (--ntasks-per-node=1): the node count and this node's index
# come from SLURM_NTASKS and SLURM_PROCID, the head node from SLURM_STEP_NODELIST. Without Slurm (or to
# override) set NNODES, NODE_RANK, MASTER_ADDR yourself — tests/test_multinode.py runs two copies on one
# machine that way.
#
# usage: node.sh OUT_DIR [MODULE:FUNCTION] [KWARGS_JSON]
#   env: NPROC_PER_NODE (ranks on this node, default: GPUs visible, else 1), MASTER_PORT (default 29500),
#        PYTHON (default python3), NNODES, NODE_RANK, MASTER_ADDR (default from Slurm)
set -euo pipefail
OUT=${1:?usage: node.sh OUT_DIR [MODULE:FUNCTION] [KWARGS_JSON]}
FUNCTION=${2:-labkit.experiments.scaling:torchrun_point}
KWARGS=${3:-"{}"}
PYTHON=${PYTHON:-python3}
NNODES=${NNODES:-${SLURM_NTASKS:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_PROCID:-0}}
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_STEP_NODELIST:-}" ]]; then
        MASTER_ADDR=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n1)
    else
        MASTER_ADDR=127.0.0.1
    fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(max(1, torch.cuda.device_count()))")
fi
echo "node.sh: node ${NODE_RANK}/${NNODES} on $(hostname), ${NPROC_PER_NODE} rank(s), head ${MASTER_ADDR}:${MASTER_PORT}" >&2
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts 0 \
    -m labkit.runtime.worker "$FUNCTION" --kwargs "$KWARGS" --out "$OUT"
