#!/usr/bin/env bash
# Runnable from an empty folder with microscale installed: bash docs/import/example.sh
set -e
python - <<'EOF'           # a stand-in for a downloaded HF Llama folder (no hub needed)
import glob, json, os
from flax import nnx
from microscale.data import train_bpe
from microscale.export import export_checkpoint
from microscale.model import ModelConfig, Transformer
cfg = ModelConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=256,
                  max_seq_len=512, rope_theta=100000.0, tie_embeddings=True)
tok = train_bpe([open(f).read() for f in glob.glob(os.path.dirname(json.__file__) + "/*.py")], 500)
export_checkpoint(Transformer(cfg, rngs=nnx.Rngs(0)), "hf-model", layer_formats="bf16",
                  tokenizer=tok)
EOF
microscale import --model hf-model --out runs/imported
TEXT=$(python -c 'import argparse; print(argparse.__file__)')
microscale eval -m hf-model --data $TEXT --seq-len 64 --batches 4 --batch-size 4
microscale eval -m runs/imported --data $TEXT --seq-len 64 --batches 4 --batch-size 4
microscale train init_from=hf-model --print-config | grep -E "^  (vocab_size: 5|rope_theta|tie_emb|tokenizer)"
microscale train init_from=hf-model model.d_ff=512 --print-config || echo "exit $?"
