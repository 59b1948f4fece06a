"""tasks/: what the policy is asked and how its answers are scored: the datasets, prompts and stop
tokens (data.py), the fail-closed rewards (rewards.py), the generated tasks with worked solutions
that pretrain.py and train.py share (arith.py, countdown.py, stargraph.py) and the box their
answers are read from (answer_box.py), and the small models' tokenizer (tokenizer.py)."""
