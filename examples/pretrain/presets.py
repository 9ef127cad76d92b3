"""The pretraining example's presets (train.py --config): a model shape, batch, schedule and data
for each; train.py's flags override any of them. A module of its own, without flags, so that
tests and tools can read the presets without defining train.py's command line."""

from model import ModelConfig

CONFIGS = {
    # model, batch, steps: trains on a 2-core CPU in a few minutes.
    "tiny": dict(model=ModelConfig(d_model=128, num_layers=2, num_heads=4, num_experts=8,
                                   expert_dim=64, top_k=2), batch_size=16, seq_len=128, steps=300,
                 lr=3e-3, warmup=30, corpus_bytes=2_000_000, eval_every=100),
    # Sized for one H100: d=1024, 8 layers, 64 experts of width 256, K=8.
    "h100": dict(model=ModelConfig(d_model=1024, num_layers=8, num_heads=16, num_experts=64,
                                   expert_dim=256, top_k=8, dtype="bfloat16"), batch_size=32,
                 seq_len=1024, steps=2000, lr=1e-3, warmup=200, corpus_bytes=40_000_000,
                 eval_every=200),
    # OLMoE-1B-7B's shape (Muennighoff et al., 2024): d=2048, 16 layers of 16 heads, 64 experts
    # of width 1024, K=8, untied embeddings over a 50,304-token byte-level BPE: 6.9B parameters,
    # 1.3B active. bf16 compute, float32 parameters and AdamW state; blocks rematerialised and
    # unrolled (scanned, the step ran 8-16% fewer tokens/s: docs/decisions.md). 16 x 4096 tokens
    # per step: 4 sequences per GPU on 4 GPUs (--expert_parallel=4); OLMoE's peak learning rate,
    # warm-up shortened to a 500-step run. The standard library alone is too small for 50,304 BPE
    # tokens (README): --corpus_dir for more.
    "olmoe_1b_7b": dict(model=ModelConfig(vocab_size=50304, d_model=2048, num_layers=16,
                                          num_heads=16, num_experts=64, expert_dim=1024, top_k=8,
                                          tie_embeddings=False, dtype="bfloat16", remat="full"),
                        batch_size=16, seq_len=4096, steps=500, lr=4e-4, warmup=50,
                        corpus_bytes=1 << 30, eval_every=50, tokenizer="bpe", vocab_size=50304),
}
