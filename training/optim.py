"""AdamW with linear warm-up and cosine decay, global-norm clipping, and a
weight-decay mask (matrices decay; norms, biases and other vectors do not).
"""
import jax
import optax


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  """Linear warm-up to train.learning_rate, cosine decay to lr * min_lr_ratio."""
  peak = train_cfg.learning_rate
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak, warmup_steps=train_cfg.warmup_steps,
      decay_steps=max(train_cfg.num_steps, train_cfg.warmup_steps + 1),
      end_value=peak * train_cfg.min_lr_ratio)


def decay_mask(params):
  """True for parameters with two or more axes (weight matrices, embeddings)."""
  return jax.tree.map(lambda p: p.ndim >= 2, params)


def make_optimizer(train_cfg) -> optax.GradientTransformation:
  parts = []
  if train_cfg.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(train_cfg.grad_clip))
  parts.append(optax.adamw(learning_rate_schedule(train_cfg), b1=train_cfg.b1, b2=train_cfg.b2,
                           weight_decay=train_cfg.weight_decay, mask=decay_mask))
  return optax.chain(*parts)
