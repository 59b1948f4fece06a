"""trainer/: train.py's plumbing: its flags and their checks (config.py), loading the data and the
policy and opening the run folder (prepare.py), checkpoints (checkpoint.py), the metrics log and
curves (runlog.py), and the learning-rate schedule it shares with pretrain.py (schedule.py); and
pretrain.py's own evaluation and quantization-aware training (pretraining.py)."""
