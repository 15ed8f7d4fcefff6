#!/usr/bin/env bash
# Train examples/train_lm.py on several machines that share nothing but an S3 bucket.
#
# The machines never talk to each other: no master address, no rendezvous. Each one needs this
# repository, `pip install -e ".[s3,fsspec]"` and S3 credentials (AWS_ACCESS_KEY_ID /
# AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role).
#
#   1. Once, anywhere:       examples/launch_s3.sh new-run            → prints RUN=s3://.../runs/<id>
#   2. On machine i of M:    RUN=s3://... MACHINE=i MACHINES=M examples/launch_s3.sh train
#      or with SLURM:        RUN=s3://... srun --ntasks=<total processes> examples/launch_s3.sh train
#   3. Anywhere:             gradientmail status "$RUN"
#
# Settings (environment): BUCKET (default gradientmail-$USER), REGION (default us-east-1),
# ENDPOINT_URL (an S3-compatible store: MinIO, R2, ...), GPUS (processes per machine, default:
# the GPUs found, else 1). Extra arguments after `train` go to train_lm.py (e.g. --steps 2000).
set -euo pipefail

BUCKET=${BUCKET:-gradientmail-${USER:-user}}
REGION=${REGION:-us-east-1}
ENDPOINT_URL=${ENDPOINT_URL:-}
endpoint_args=()
[[ -n "$ENDPOINT_URL" ]] && endpoint_args=(--endpoint-url "$ENDPOINT_URL")
here=$(cd "$(dirname "$0")" && pwd)

new_run() {
    # Create the bucket if it is missing (no-op when it exists and is yours), then pick a prefix
    # no run has used: claims are permanent, so every run needs a fresh one.
    BUCKET="$BUCKET" REGION="$REGION" ENDPOINT_URL="$ENDPOINT_URL" python - <<'PY'
import os, boto3, botocore
s3 = boto3.client("s3", region_name=os.environ["REGION"], endpoint_url=os.environ["ENDPOINT_URL"] or None)
bucket, region = os.environ["BUCKET"], os.environ["REGION"]
try:
    s3.head_bucket(Bucket=bucket)
except botocore.exceptions.ClientError:
    extra = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
    s3.create_bucket(Bucket=bucket, **extra)
PY
    echo "RUN=s3://$BUCKET/runs/$(date -u +%Y%m%d-%H%M%S)-$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')"
}

train() {
    : "${RUN:?set RUN to the s3:// prefix printed by new-run, the same on every machine}"
    if [[ -n "${SLURM_PROCID:-}" ]]; then
        # srun starts one task per process; train_lm.py reads SLURM_PROCID and SLURM_NTASKS.
        exec python "$here/train_lm.py" --mailbox "$RUN" ${endpoint_args[@]+"${endpoint_args[@]}"} "$@"
    fi
    local gpus=${GPUS:-$(python -c "import torch; print(max(1, torch.cuda.device_count()))")}
    # torchrun here only starts the local processes (RANK 0..gpus-1); --machine makes the
    # learner ids and lanes global: rank = MACHINE * gpus + RANK, lanes = MACHINES * gpus.
    exec torchrun --standalone --nproc_per_node="$gpus" "$here/train_lm.py" --mailbox "$RUN" \
        --machine "${MACHINE:?set MACHINE to the index of this machine, 0 to MACHINES-1}" \
        --machines "${MACHINES:?set MACHINES to the number of machines}" ${endpoint_args[@]+"${endpoint_args[@]}"} "$@"
}

case "${1:-}" in
    new-run) new_run ;;
    train) shift; train "$@" ;;
    *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
