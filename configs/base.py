"""Every config field, with its default and a one-line comment.

Other configs start from `get_config()` here and change what they need. Load
with `ml_collections.config_flags.DEFINE_config_file(..., lock_config=True)`
so that `--config.model.pos_emb=rope` works and a misspelt field fails.
Choices are checked in one place: `configs/validation.py`.
"""
from ml_collections import config_dict


def get_config() -> config_dict.ConfigDict:
  c = config_dict.ConfigDict()

  m = c.model = config_dict.ConfigDict()
  m.family = "decoder"  # decoder | encoder | encoder_decoder
  m.vocab_size = 1024  # rows of the embedding; >= the tokenizer's vocab_size
  m.real_vocab_size = config_dict.placeholder(int)  # the rows that are tokens; the logits of
  #   the rows past it (padding: 50,304 rows for GPT-2's 50,257) are masked out of the softmax,
  #   loss and sampling; None: all vocab_size rows
  m.d_model = 128  # model width d
  m.num_layers = 2  # layers (the encoder's, for encoder_decoder)
  m.num_decoder_layers = config_dict.placeholder(int)  # encoder_decoder; None: num_layers
  m.num_heads = 4  # query heads h
  m.num_kv_heads = config_dict.placeholder(int)  # KV heads g: h MHA, <h GQA, 1 MQA; None: h
  m.head_dim = config_dict.placeholder(int)  # d_k; None: d_model // num_heads
  m.attention = "mha"  # self-attention: a model/attention_kinds.py ATTENTIONS entry: mha (h
  #   query heads over num_kv_heads KV heads: MHA, GQA, MQA) | mla (DeepSeek's multi-head latent
  #   attention, decoders with pos_emb=rope: the five fields below, no num_kv_heads or head_dim;
  #   docs/models.md, "Multi-head latent attention")
  m.q_lora_rank = config_dict.placeholder(int)  # mla: queries through a latent this wide and its
  #   RMSNorm (DeepSeek-V3: 1536); None or 0: one projection from d (DeepSeek-V2-Lite)
  m.kv_lora_rank = config_dict.placeholder(int)  # mla: the latent each head's keys and values are
  #   expanded from; the KV cache keeps it and the rope key instead of K and V (DeepSeek-V3: 512)
  m.qk_nope_head_dim = config_dict.placeholder(int)  # mla: each head's query and key width
  #   without RoPE, the key's expanded from the latent (DeepSeek-V3: 128)
  m.qk_rope_head_dim = config_dict.placeholder(int)  # mla: each head's query width with RoPE,
  #   and the one rotated key every head shares (DeepSeek-V3: 64; even)
  m.v_head_dim = config_dict.placeholder(int)  # mla: each head's value width (DeepSeek-V3: 128)
  m.d_ff = 512  # MLP hidden width (4d for gelu, about 8/3 d for the gated swiglu, geglu)
  m.max_len = 256  # longest sequence (size of a learned position table)
  m.pos_emb = "rope"  # position scheme: a model/positions.py POSITIONS entry (every choice of
  #   a registered field, with a line each: docs/models.md, "Choices")
  m.attention_score = "softmax"  # scores to weights: a model/scores.py SCORES entry
  m.relative_buckets = 32  # relative: buckets of key - query offsets (T5's num_buckets)
  m.relative_max_distance = 128  # relative: offsets at least this far share the last bucket
  m.rope_theta = 10000.0  # RoPE base: theta_i = rope_theta^(-2i/d_k)
  m.rope_scaling = "none"  # context extension: a model/embeddings.py ROPE_SCALINGS entry
  m.rope_scaling_factor = 1.0  # how many times longer than rope_original_max_len
  m.rope_original_max_len = 256  # context the RoPE model was trained at (yarn, llama3)
  m.rope_beta_fast = 32.0  # yarn: pairs turning more often than this over the context are kept
  m.rope_beta_slow = 1.0  # yarn: pairs turning less often than this are divided by the factor
  m.rope_attention_factor = config_dict.placeholder(float)  # yarn: multiplies cos and sin;
  #   None: 0.1 ln(rope_scaling_factor) + 1
  m.rope_truncate = True  # yarn: round the ramp's ends to whole pair indices (gpt-oss: False)
  m.rope_low_freq_factor = 1.0  # llama3: wavelengths over original/low are divided by the factor
  m.rope_high_freq_factor = 4.0  # llama3: wavelengths under original/high are kept
  m.partial_rotary_factor = 1.0  # rope: the fraction of each head's dims RoPE rotates, the
  #   first head_dim x this (even) dims, the rest pass unrotated (Qwen3-Next: 0.25); 1.0: all
  m.norm = "rmsnorm"  # a model/norms.py NORMS entry
  m.norm_position = "pre"  # pre | post
  m.norm_eps = 1e-6  # epsilon inside the norm's square root
  m.mlp = "swiglu"  # a model/mlp.py MLPS entry (gated ones have a third matrix, d_ff about 8/3 d)
  m.num_experts = 0  # mixture of experts (model/moe.py): experts per MoE layer; 0: dense MLPs
  m.experts_per_token = 2  # MoE: experts each token is routed to (top-k)
  m.moe_d_ff = config_dict.placeholder(int)  # MoE: each expert's hidden width; None: d_ff
  m.num_shared_experts = 0  # MoE: always-on experts (DeepSeek), one MLP of this many x moe_d_ff
  m.moe_shared_expert_gate = False  # MoE: the shared experts' output times sigmoid(x W_g),
  #   W_g [d, 1] (Qwen2-MoE, Qwen3-Next's shared_expert_gate); needs num_shared_experts > 0
  m.moe_router = "softmax_topk_norm"  # MoE: a model/moe.py ROUTERS entry
  m.moe_n_group = 1  # moe_router=deepseek: the experts in this many groups (DeepSeek-V3's n_group)
  m.moe_topk_group = 1  # moe_router=deepseek: tokens choose among the experts of this many
  #   groups, those with the best sums of their two best affinities (DeepSeek-V3's topk_group)
  m.moe_routed_scaling_factor = 1.0  # moe_router=deepseek: the chosen experts' weights, which
  #   sum to 1, times this (DeepSeek-V3's routed_scaling_factor, 2.5)
  m.moe_group_mask_fill = "-inf"  # moe_n_group > 1: masked groups' score, "-inf" or "0" (older)
  m.moe_layers = config_dict.placeholder(tuple)  # MoE: the layers (0-based) with experts, the
  #   others dense (DeepSeek's first dense layers: (1, 2, ...)); None: every layer
  m.moe_capacity_factor = 0.0  # MoE: each expert takes at most ceil(this x tokens x k / E) of a
  #   device's tokens, the rest dropped (Switch, GShard); 0: dropless
  m.use_bias = False  # biases in the attention and MLP projections (all or none)
  m.qkv_bias = config_dict.placeholder(bool)  # biases of W_Q, W_K, W_V (Qwen2); mla: of q_a_proj
  #   and kv_a_proj (DeepSeek's attention_bias; its q_proj has none); None: use_bias
  m.out_bias = config_dict.placeholder(bool)  # bias of the attention output W_O; None: use_bias
  m.mlp_bias = config_dict.placeholder(bool)  # biases of the MLP matrices; None: use_bias
  m.scale_embeddings = config_dict.placeholder(bool)  # token embeddings times sqrt(d_model)
  #   (Gemma, the original transformer); None: True for pos_emb=sinusoidal, else False
  m.attention_scale = config_dict.placeholder(float)  # multiplies Q K^T; None: 1/sqrt(head_dim)
  #   (mla: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim); DeepSeek's yarn mscale_all_dim m times
  #   (0.1 m ln(rope_scaling_factor) + 1)^2, docs/models.md); 1.0: unscaled (T5)
  m.tie_embeddings = True  # output head = embedding^T
  m.decoder_start = "bos"  # encoder_decoder: the decoder's first input token, in training and
  #   generation: bos | pad (T5 starts from the pad id) | eos (BART starts from the eos id)
  m.scale_head_input = False  # final hidden states times d_model^-0.5 before the output head
  #   (T5 v1.0 with its tied head)
  m.type_vocab_size = 0  # rows of the token-type embedding added to the tokens (BERT's
  #   segments A/B: 2; the model takes token_type_ids, zeros by default); 0: none
  m.embedding_norm = False  # a norm (model.norm) after token + position (+ type) embeddings
  #   (BERT, BART)
  m.head_transform = False  # before the output projection: dense d->d with bias, the MLP's
  #   activation, a norm (BERT's masked-LM head)
  m.output_bias = False  # a bias over the vocabulary added to the logits (BERT)
  m.attention_output_gate = False  # mha decoders: a gate projection W_G [d, h, d_k] beside
  #   W_Q; each head's attention output times sigmoid(x W_G) before W_O (Qwen3-Next)
  m.qk_norm = False  # RMSNorm (learned scale) of each head's queries and keys over head_dim,
  #   before RoPE (Qwen3, OLMo-2, Gemma-3)
  m.attn_softcap = config_dict.placeholder(float)  # attention scores become c tanh(s / c)
  #   (Gemma-2: 50.0); None: no cap
  m.final_softcap = config_dict.placeholder(float)  # final logits become c tanh(x / c)
  #   (Gemma-2: 30.0); None: no cap
  m.num_labels = 0  # classes of a sequence-classification head (train.objective=classify), in
  #   place of the LM head; 0: the LM head
  m.pooling = "cls"  # the hidden state a classifier or training.embed reads: cls (the first
  #   token, BERT's) | mean (over the real tokens) | last (the last real token, as decoders)
  m.pooler = False  # classify with pooling=cls: BERT's pooler, dense d->d + tanh, before it
  m.classifier_bias = config_dict.placeholder(bool)  # a bias on the classifier's logits
  #   (BERT: yes, transformers' decoder classifiers: no); None: use_bias
  m.sliding_window = config_dict.placeholder(int)  # decoder self-attention sees the last this
  #   many keys, itself included (Mistral's sliding_window); None: all
  m.sliding_window_layers = config_dict.placeholder(tuple)  # the layers (0-based) whose
  #   self-attention has the window, e.g. (1, 2, 3) (Qwen2's layer_types); None: all
  m.layer_types = config_dict.placeholder(tuple)  # every layer's kind, a tuple that repeats
  #   to num_layers (transformers' layer_types): full_attention | sliding_attention (the
  #   window) | linear_attention (Gated DeltaNet, model/gated_deltanet.py), +moe for experts,
  #   e.g. ('linear_attention',) * 3 + ('full_attention',); scanned stacks scan its cycle;
  #   None: sliding_window_layers and moe_layers say
  m.linear_num_key_heads = config_dict.placeholder(int)  # linear_attention layers: query and
  #   key heads; None: num_heads
  m.linear_num_value_heads = config_dict.placeholder(int)  # linear_attention: value heads, a
  #   multiple of the key heads (each key head serves as many); None: linear_num_key_heads
  m.linear_key_head_dim = config_dict.placeholder(int)  # linear_attention: d_k; None: head_dim
  m.linear_value_head_dim = config_dict.placeholder(int)  # linear_attention: d_v; None:
  #   linear_key_head_dim
  m.linear_conv_kernel_dim = 4  # linear_attention: the width of the short causal convolution
  #   over q, k and v
  m.linear_chunk_size = 64  # linear_attention: tokens per chunk of the chunked delta rule (the
  #   training form; decoding runs the recurrent one)
  m.scan_layers = config_dict.placeholder(bool)  # True: each stack runs one block under
  #   nnx.scan over parameters stacked on a `layers` axis (compile time independent of depth;
  #   layers described by layer_types scan their cycle, one body of its layers, the rest as
  #   runs; layers that differ by sliding_window_layers or moe_layers scan one run of
  #   identical consecutive layers at a time); False: a Python loop over per-layer blocks;
  #   None: scan unless sliding_window_layers or moe_layers make the layers differ, and a
  #   run resumed or restored from keeps its saved layout
  m.scan_unroll = 2  # scanned stacks: blocks per iteration of the scan (jax.lax.scan's unroll);
  #   the loop's own cost is paid num_layers / scan_unroll times, and the program holds
  #   scan_unroll blocks (1: the smallest program; num_layers: as fast as the Python loop)
  m.attention_impl = "auto"  # a model/attention.py IMPLEMENTATIONS entry (reference, xla, cudnn,
  #   pallas: our kernels, auto: chosen per device and inputs)
  m.pallas_lowering = "auto"  # our kernel for pallas: auto (Mosaic GPU on H100/H200 for
  #   16-bit, head_dim 64/128; Mosaic TPU on TPUs; Triton elsewhere) | triton | mosaic_gpu |
  #   mosaic_tpu (interpreted on CPU)
  m.dtype = "float32"  # compute dtype: float32 | bfloat16 | float16
  m.param_dtype = "float32"  # parameter dtype: float32 | bfloat16
  m.fp8 = "none"  # attention's and the MLP's projections as FP8 products (model/fp8.py): none |
  #   current (each tensor scaled by its own amax) | delayed (by the amax history's maximum)
  m.fp8_history = 16  # model.fp8=delayed: the amaxes each tensor's scale is taken over
  m.init_std = 0.02  # std of the normal initialiser of every weight matrix
  m.parametrization = "sp"  # sp (standard) | mup (maximal update, docs/models.md "μP"): the
  #   hidden matrices' init and learning rate, the logits and attention scale follow the width
  m.mup_base_width = config_dict.placeholder(int)  # μP: the d_model the hyperparameters were
  #   tuned at (width multiplier d_model / this); None: d_model
  m.mup_output_mult = 1.0  # μP: the logits' multiplier at the base width (logits times this /
  #   width multiplier); tune it there with the learning rate (docs/models.md "μP")
  m.mup_base_depth = config_dict.placeholder(int)  # depth-μP (sp or mup): the num_layers the
  #   hyperparameters were tuned at; residual branches and the hidden matrices' learning rate
  #   times sqrt(this / num_layers). None: off

  t = c.tokenizer = config_dict.ConfigDict()
  t.kind = "bpe"  # bpe | spm_bpe | spm_unigram (trained on the train split once)
  t.vocab_size = 1024  # vocabulary including the special tokens
  t.path = ""  # a saved tokenizer (dir or .model) or a Hugging Face tokenizer dir; "" trains one
  t.train_bytes = 100_000_000  # at most about this much train text is sampled to train one

  d = c.data = config_dict.ConfigDict()
  d.source = "stdlib"  # stdlib | pydoc | embedded (both) | files | jsonl | arrayrecord | parquet
  d.paths = ""  # files or globs, comma-separated, for files | jsonl | arrayrecord | parquet
  d.mixture = ""  # several sources read at once, each drawn by its weight: source[:paths]=weight,
  #   comma-separated, e.g. "stdlib=0.7,jsonl:notes/*.jsonl=0.3" (docs/data.md, "Mixtures of
  #   sources"); "": data.source and data.paths alone
  d.jsonl_field = "text"  # the field of each JSONL record that holds the text
  d.parquet_column = "text"  # the string column of the Parquet files that holds the text
  d.val_percent = 5  # percent of the documents held out for validation
  d.packing = "packed"  # packed (segment ids, per-document positions) | concat (EOS between)
  d.cache_dir = ""  # tokenised-corpus cache (tokens/, index/); "": $TRANSFORMER_LAB_CACHE, else
  #   ~/.cache/transformer_lab (the machine's cache; `make clean-cache` removes it, docs/install.md)
  d.num_workers = 0  # Grain worker processes (0: in the main process)
  d.tokenize_workers = 0  # tokenisation processes per process; 0: host's cores / its processes
  d.tokenize_wait_s = 3600.0  # longest wait for a shard another process tokenises
  d.verify_cache = False  # re-read every shard and compare with its cache entry (see docs/data.md)
  d.task = "none"  # seq2seq task: none | reverse | sort | addition | code_summary | pairs;
  #   classify task: stdlib_package (built in) | labelled (your .tsv/.jsonl in data.paths)
  d.task_size = 20000  # reverse | sort | addition: training examples drawn
  d.task_test_size = 500  # reverse | sort | addition: held-out (validation) examples
  d.task_min_len = 4  # reverse | sort | addition: shortest string (digits per number)
  d.task_max_len = 24  # reverse | sort | addition: longest string (digits per number)
  d.task_test_min_len = 0  # shortest held-out string; 0: task_min_len (raise it to test longer)
  d.task_seed = 0  # reverse | sort | addition: which examples are drawn
  d.seed = config_dict.placeholder(int)  # data order (the shuffle) and MLM masks; None: train.seed
  d.task_addition_format = "plain"  # addition: plain ("12+5" -> "17") | aligned (numbers
  # zero-padded to task_max_len digits, sum least-significant digit first: "012+005" -> "7100")
  d.src_field = "src"  # pairs: JSONL field or TSV header column of the source
  d.tgt_field = "tgt"  # pairs: JSONL field or TSV header column of the target
  d.text_field = "text"  # labelled: JSONL field or TSV header column of the text
  d.text_pair_field = ""  # labelled: the second text of a pair (token type 1); "": none
  d.label_field = "label"  # labelled: JSONL field or TSV header column of the label
  d.labels = ()  # classify: the class names in id order; (): the train split's, sorted (the
  #   run's config.json keeps them)
  d.pair_specials = False  # encoder_decoder pairs marked as the tokenizer marks a model input
  #   (its special tokens: T5's "src </s>", BART's "<s> src </s>", the target likewise); set by
  #   convert.py from_hf for T5 and BART, as they were trained; False: bare src, tgt EOS

  tr = c.train = config_dict.ConfigDict()
  tr.objective = "next_token"  # next_token | seq2seq | mlm | classify
  tr.num_steps = 1000  # optimizer steps
  tr.token_budget = 0.0  # > 0: num_steps = floor(token_budget / (batch_size x seq_len)); 0: unused
  tr.flop_budget = 0.0  # > 0: num_steps = floor(flop_budget / training FLOPs per step); 0: unused
  tr.batch_size = 16  # sequences per step (global, across all devices)
  tr.seq_len = 128  # tokens per sequence (seq2seq: prefix-LM row, or encoder-decoder source)
  tr.tgt_seq_len = 0  # encoder_decoder seq2seq: target tokens (tgt_in/tgt_out); 0: seq_len
  tr.grad_accum_steps = 1  # micro-batches per step (batch_size must divide)
  tr.optimizer = "adamw"  # adamw | adafactor | lion | muon (docs/training.md, Optimizers)
  tr.learning_rate = 3e-3  # peak learning rate (lion: about 3-10x lower than adamw's; muon: of
  #   its AdamW part, and of its matrices unless muon_lr)
  tr.embedding_lr_mult = 1.0  # the input weights' update (token embedding, so a tied head's
  #   weights too, and a learned position table) times this: their learning rate relative to
  #   learning_rate's (under μP a width-independent hyperparameter, as learning_rate is)
  tr.schedule = "cosine"  # after the linear warm-up: cosine | linear | constant | inverse_sqrt |
  #   wsd (warm-up, stable, decay); formulas in docs/training.md
  tr.warmup_steps = 100  # linear warm-up steps
  tr.warmup_fraction = config_dict.placeholder(float)  # set: warmup_steps = round(this x
  #   num_steps), after a budget sets num_steps (a ladder's sizes warm up alike); None: unused
  tr.min_lr_ratio = 0.1  # cosine, linear and wsd decay to learning_rate * min_lr_ratio
  tr.decay_fraction = config_dict.placeholder(float)  # wsd: the last this fraction of num_steps
  #   decays linearly; None: 0.2
  tr.weight_decay = 0.1  # decoupled, times the learning rate, every optimizer: on matrices,
  #   embeddings and position tables; not on norms or biases
  tr.b1 = 0.9  # Adam beta1 (adamw, muon's AdamW part)
  tr.b2 = 0.95  # Adam beta2 (adamw, muon's AdamW part)
  tr.lion_b1 = config_dict.placeholder(float)  # lion: update sign(b1 m + (1 - b1) g); None: 0.9
  tr.lion_b2 = config_dict.placeholder(float)  # lion: momentum m = b2 m + (1 - b2) g; None: 0.99
  tr.adafactor_decay_rate = config_dict.placeholder(float)  # adafactor: second moments decay
  #   with 1 - step^-rate; None: 0.8
  tr.adafactor_clipping = config_dict.placeholder(float)  # adafactor: each update clipped to
  #   this RMS; 0: not clipped; None: 1.0
  tr.adafactor_momentum = config_dict.placeholder(float)  # adafactor: first-moment decay (one
  #   more copy of the parameters); None: no first moment
  tr.adafactor_param_scale = config_dict.placeholder(bool)  # adafactor: steps relative to each
  #   parameter's RMS (the paper's learning_rate: 1e-2); None: True
  tr.adafactor_min_dim_to_factor = config_dict.placeholder(int)  # adafactor: second moments of
  #   weights with two axes at least this long are kept as a row and a column; None: 128
  tr.muon_lr = config_dict.placeholder(float)  # muon: peak learning rate of the hidden matrices
  #   (Muon); None: learning_rate
  tr.muon_momentum = config_dict.placeholder(float)  # muon: Nesterov momentum; None: 0.95
  tr.muon_ns_steps = config_dict.placeholder(int)  # muon: Newton-Schulz iterations; None: 5
  tr.muon_rms = config_dict.placeholder(float)  # muon: updates scaled to this RMS, so that
  #   AdamW's learning_rate and weight_decay carry over (Moonlight); 0: Keller Jordan's
  #   sqrt(max(1, fan_out / fan_in)) (with muon_lr about 0.02); None: 0.2
  tr.z_loss = 0.0  # weight of the z-loss, mean log^2 Z of the softmax normaliser (PaLM: 1e-4)
  tr.moe_aux_loss = 0.0  # mixture of experts: weight of the load-balancing loss (Mixtral: 0.02)
  tr.router_z_loss = 0.0  # mixture of experts: weight of the router z-loss (ST-MoE: 1e-3)
  tr.moe_seq_aux_loss = 0.0  # mixture of experts: weight of DeepSeek-V3's sequence-wise balance
  #   loss, sum_e f_e P_e per sequence (its alpha, 1e-4)
  tr.moe_bias_update_rate = 0.0  # model.moe_router=deepseek: gamma of DeepSeek-V3's auxiliary-
  #   loss-free balancing; after each step every expert's selection bias moves by gamma x
  #   sign(mean load - its load) in its layer (DeepSeek-V3: 0.001); 0: off, the bias stays 0
  tr.mtp_depth = 0  # multi-token prediction (DeepSeek-V3): D modules after the decoder, module
  #   k predicting token i+k+1 through the shared embedding and head; 0: off (next_token only)
  tr.mtp_weight = 0.3  # lambda of the MTP loss, lambda / D x the sum of the D depths' mean
  #   cross-entropies, added to the main loss (DeepSeek-V3: 0.3, then 0.1)
  tr.grad_clip = 1.0  # global-norm clipping; 0 disables
  tr.remat = config_dict.FieldReference("none", field_type=object)  # what the backward pass
  #   recomputes (model/remat.py): none | full (each block from its input) | save_dots |
  #   save_dots_except_mlp | save_qkv_proj | save_attention_out | save_out_proj (recompute the
  #   block, keep what the name says); True and False (configs, flags and runs from before the
  #   names) mean full and none
  tr.loss_chunk_size = 0  # tokens per chunk of the LM head and loss (no f32 [B, T, V]); 0: off
  tr.loss_impl = "xla"  # the LM head and loss: xla (the logits as an array, whole or in
  #   loss_chunk_size chunks) | pallas (one fused kernel, model/kernels/fused_loss.py: the
  #   logits never leave the chip; Triton on a GPU, Mosaic on a TPU, the interpreter on a
  #   CPU) | auto (pallas compiled for a GPU, for a head without soft-cap or bias and no loss
  #   chunks; else xla)
  tr.compilation_cache_dir = ""  # persistent compilation cache: a restarted run on the same
  #   machine type reads its compiled steps back; "": $TRANSFORMER_LAB_COMPILATION_CACHE, else
  #   jax/ in $TRANSFORMER_LAB_CACHE or ~/.cache/transformer_lab; "none": compile at every start
  tr.reuse_host_memory = True  # CPU runs: glibc keeps freed memory for the next step (no
  #   page faults on XLA's per-step buffers; resident memory stays at its peak); docs/architecture.md
  tr.seed = 0  # parameter init; data order and MLM masking too while data.seed is None
  tr.log_every = 10  # steps between metric lines
  tr.trackers = "tensorboard"  # where metric lines, the config and eval.py's reports also go,
  #   comma-separated: tensorboard | wandb | mlflow ("": metrics.jsonl only; docs/tracking.md)
  tr.profile_steps = ""  # "first,last": a jax.profiler trace of these steps (process 0) in
  #   <workdir>/profile (docs/tracking.md); "": none
  tr.eval_every = config_dict.placeholder(int)  # steps between validation passes (of
  #   eval_steps batches, logged as val<eval_steps>_loss); None: num_steps // 10, so 10 points
  tr.eval_steps = 10  # validation batches per pass (eval.py scores the whole split)
  tr.downstream_tasks = ""  # lm-eval tasks scored at every validation pass, comma-separated
  #   (hellaswag,arc_easy; docs/downstream.md; needs lm-eval); "": none
  tr.downstream_task_dir = ""  # a directory of your own lm-eval task YAMLs for downstream_tasks
  tr.downstream_limit = 0  # downstream_tasks: examples per task (the first ones); 0: all
  tr.downstream_batch_size = 32  # downstream_tasks: rows per forward pass (or generation call)
  tr.checkpoint_every = 200  # steps between checkpoints
  tr.keep_checkpoints = 3  # checkpoints kept on disk
  tr.restore_from = ""  # a run's workdir: start from its newest parameters, cast to
  # model.param_dtype, and its tokenizer (a tokenizer.path must be that one); new optimizer, step 0
  tr.restore_step = config_dict.placeholder(int)  # with restore_from: its checkpoint of this
  #   step; None: its newest intact one
  tr.restore_branch = False  # with restore_from: continue its optimizer state, step and data
  #   position too, so that the schedule goes on from its step (a WSD decay branched from a
  #   stable-phase checkpoint, docs/training.md); num_steps counts from its step 0
  tr.mlm_probability = 0.15  # masked-LM: fraction of tokens selected
  tr.peak_tflops = 0.0  # per-device peak for MFU; 0: look up the device (none on CPU)
  tr.peer_timeout_s = 600.0  # multi-process: exit (status 1) after this long without a step
  tr.allow_config_changes = False  # resume a workdir with fields outside
  #   training/workdir.py's RESUME_SAFE_FIELDS changed (recorded in config_history.jsonl)
  tr.skip_memory_check = False  # start even when the memory estimate exceeds the device's

  me = c.mesh = config_dict.ConfigDict()
  me.data = -1  # data-parallel axis; -1: the devices left over
  me.fsdp = 1  # parameter/optimizer-state sharding axis
  me.expert = 1  # expert-parallel axis: a mixture of experts' experts split over this many
  #   devices, tokens sent to them by all-to-all (the batch splits over it too)
  me.context = 1  # context-parallel axis: each row's sequence split over this many devices
  #   (decoders; docs/context_parallel.md)
  me.context_strategy = "auto"  # ring (K/V blocks passed round the devices) | all_gather (K/V
  #   gathered once per layer) | auto (all_gather where num_kv_heads x context <= num_heads)
  me.tensor = 1  # tensor-parallel axis (heads, MLP hidden)
  me.rules = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
              ("mlp", "tensor"), ("head_dim", None), ("norm", None), ("expert", "expert"),
              ("latent", "fsdp"), ("layers", None))  # logical -> mesh axis or None; `latent`:
  #   the input width of MLA's up-projections (its query and KV latents)
  return c


# The value a field added after a run was saved has for that run, where it is
# not the field's default: runs saved before `model.scan_layers` looped.
BEFORE_FIELD = {"model": {"scan_layers": False}}
