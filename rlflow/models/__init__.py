"""Models: loading the policy and reference, and what rlflow adapts in them (LoRA, vision towers, MoE, RMSNorm, LM
head, dropout)."""
