"""Reward functions written for TRL, unchanged: gspo-train runs them through fleet_reward.py.

Each takes the completions (and whatever else it names: prompts, completion_ids, the dataset's
columns) as lists, one entry per completion, and returns one float per completion (None where
it does not apply), as TRL's GRPOTrainer expects.
"""
import re


def reward_len(completions, **kwargs):
    """TRL's documentation example: completions close to 20 characters score best."""
    return [-abs(20 - len(completion)) for completion in completions]


def exact_answer(completions, answer, **kwargs):
    """1.0 when the last number of the completion equals the number after the answer's ####
    (GSM8K's format), 0.0 otherwise; None for a row without a reference number."""
    rewards = []
    for completion, reference in zip(completions, answer):
        ref = re.findall(r"-?\d+(?:\.\d+)?", str(reference).split("####")[-1])
        if not ref:
            rewards.append(None)
            continue
        got = re.findall(r"-?\d+(?:\.\d+)?", completion)
        rewards.append(1.0 if got and float(got[-1]) == float(ref[0]) else 0.0)
    return rewards


def short_in_tokens(completions, completion_ids, **kwargs):
    """Fewer tokens score higher: 1 / (1 + number of completion tokens)."""
    return [1.0 / (1 + len(ids)) for ids in completion_ids]
