"""A LeRobot pi05 policy directory as LeRobot 0.6 writes one, file by file: config.json,
model.safetensors with the "model." prefix, the processor JSON files and their stats
safetensors. The tensors are the tiny model's."""
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_np
from safetensors.torch import load_file, save_file

from oxygen_ros.model import save_checkpoint
from oxygen_ros.model.checkpoint import EMBED, EXP, LM_HEAD
from support.models import tiny_model

CAMERAS = ('front', 'wrist')  # not the model config's slot names, and fewer of them


STATE_DIM, ACTION_DIM, CHUNK, N_STEPS, TOKENS, DENOISE = 4, 5, 6, 3, 48, 7


PRE_STATS = 'policy_preprocessor_step_3_normalizer_processor.safetensors'


POST_STATS = 'policy_postprocessor_step_0_unnormalizer_processor.safetensors'


STATE_STATS = {'mean': [0.5, -1.0, 2.0, 0.0], 'std': [2.0, 0.5, 4.0, 1.0],
               'q01': [-1.0, -3.0, 0.0, -0.5], 'q99': [3.0, 1.0, 10.0, 0.5],
               'min': [-2.0, -4.0, -1.0, -1.0], 'max': [4.0, 2.0, 12.0, 1.0]}


ACTION_STATS = {'mean': [1.0, -2.0, 0.0, 3.0, 0.5], 'std': [0.5, 2.0, 3.0, 0.25, 1.5],
                'q01': [-1.0, -5.0, 2.0, 0.0, -0.2], 'q99': [1.0, 5.0, 6.0, 10.0, 0.2],
                'min': [-2.0, -6.0, 1.0, -1.0, -1.0], 'max': [2.0, 6.0, 7.0, 11.0, 1.0]}


MAPS = {'quantiles': {'VISUAL': 'IDENTITY', 'STATE': 'QUANTILES', 'ACTION': 'QUANTILES'},
        'mean_std': {'VISUAL': 'IDENTITY', 'STATE': 'MEAN_STD', 'ACTION': 'MEAN_STD'}}


def features():
    out = {f'observation.images.{c}': {'type': 'VISUAL', 'shape': [3, 56, 56]} for c in CAMERAS}
    out['observation.state'] = {'type': 'STATE', 'shape': [STATE_DIM]}
    return out


def config_json(norm_map):
    # The keys LeRobot 0.6.1's PI05Config writes, training ones included; the variant names
    # are the real ones while the tensors are tiny, as a user's test policy would have them.
    return {
        'type': 'pi05', 'n_obs_steps': 1, 'input_features': features(),
        'output_features': {'action': {'type': 'ACTION', 'shape': [ACTION_DIM]}},
        'device': 'cpu', 'use_amp': False, 'use_peft': False, 'push_to_hub': True,
        'repo_id': None, 'private': None, 'tags': None, 'license': None,
        'pretrained_path': None, 'pretrained_revision': None,
        'paligemma_variant': 'gemma_2b', 'action_expert_variant': 'gemma_300m',
        'dtype': 'float32', 'chunk_size': CHUNK, 'n_action_steps': N_STEPS,
        'max_state_dim': 32, 'max_action_dim': 8, 'num_inference_steps': DENOISE,
        'time_sampling_beta_alpha': 1.5, 'time_sampling_beta_beta': 1.0,
        'time_sampling_scale': 0.999, 'time_sampling_offset': 0.001, 'min_period': 0.004,
        'max_period': 4.0, 'use_relative_actions': False, 'relative_exclude_joints': ['gripper'],
        'action_feature_names': None, 'rtc_config': None, 'image_resolution': [56, 56],
        'empty_cameras': 0, 'tokenizer_max_length': TOKENS, 'normalization_mapping': norm_map,
        'gradient_checkpointing': False, 'compile_model': False, 'compile_mode': 'max-autotune',
        'freeze_vision_encoder': False, 'train_expert_only': False, 'optimizer_lr': 2.5e-05,
        'optimizer_betas': [0.9, 0.95], 'optimizer_eps': 1e-08, 'optimizer_weight_decay': 0.01,
        'optimizer_grad_clip_norm': 1.0, 'scheduler_warmup_steps': 1000,
        'scheduler_decay_steps': 30000, 'scheduler_decay_lr': 2.5e-06}


def processors(norm_map, tokens=TOKENS):
    normalizer = {'eps': 1e-08, 'features': {**features(), 'action': {
        'type': 'ACTION', 'shape': [ACTION_DIM]}}, 'norm_map': norm_map}
    pre = {'name': 'policy_preprocessor', 'steps': [
        {'registry_name': 'rename_observations_processor', 'config': {'rename_map': {}}},
        {'registry_name': 'to_batch_processor', 'config': {}},
        {'registry_name': 'relative_actions_processor',
         'config': {'enabled': False, 'exclude_joints': ['gripper'], 'action_names': None}},
        {'registry_name': 'normalizer_processor', 'config': normalizer, 'state_file': PRE_STATS},
        {'registry_name': 'pi05_prepare_state_tokenizer_processor_step', 'config': {}},
        {'registry_name': 'tokenizer_processor',
         'config': {'max_length': tokens, 'task_key': 'task', 'padding_side': 'right',
                    'padding': 'max_length', 'truncation': True,
                    'tokenizer_name': 'google/paligemma-3b-pt-224'}},
        {'registry_name': 'device_processor', 'config': {'device': 'cpu', 'float_dtype': None}}]}
    post = {'name': 'policy_postprocessor', 'steps': [
        {'registry_name': 'unnormalizer_processor',
         'config': {**normalizer, 'features': {'action': normalizer['features']['action']}},
         'state_file': POST_STATS},
        {'registry_name': 'absolute_actions_processor', 'config': {'enabled': False}},
        {'registry_name': 'device_processor', 'config': {'device': 'cpu', 'float_dtype': None}}]}
    return pre, post


def stats_tensors():
    out = {}
    for key, stats in (('observation.state', STATE_STATS), ('action', ACTION_STATS)):
        for name, v in stats.items():
            out[f'{key}.{name}'] = np.asarray(v, np.float32)
    return out


def write_policy(root, weights, norm_map=MAPS['quantiles'], stats=True, edit=None):
    root.mkdir()
    (root / 'model.safetensors').write_bytes(weights.read_bytes())
    meta = config_json(dict(norm_map))
    pre, post = json.loads(json.dumps(processors(norm_map)))  # edits must not reach MAPS
    if edit:
        edit(meta, pre, post)
    (root / 'config.json').write_text(json.dumps(meta, indent=4))
    if stats:
        (root / 'policy_preprocessor.json').write_text(json.dumps(pre, indent=2))
        (root / 'policy_postprocessor.json').write_text(json.dumps(post, indent=2))
        save_np(stats_tensors(), str(root / PRE_STATS))
        save_np(stats_tensors(), str(root / POST_STATS))
    return root


def lerobot_weights(folder: Path) -> Path:
    """The tiny model's tensors in LeRobot's saved layout: every key under "model.", the
    tied matrix as both embed_tokens and lm_head, plus the expert's unused lm_head. Norm and
    adaRMS offsets are away from zero (tiny_model), so they matter."""
    model = tiny_model(0)
    tmp = save_checkpoint(model, folder / 'openpi')
    t = load_file(str(tmp / 'model.safetensors'))
    t[EMBED] = t[LM_HEAD].clone()
    t[EXP + 'lm_head.weight'] = torch.zeros(model.cfg.vocab, model.cfg.expert.width)
    path = folder / 'lerobot.safetensors'
    save_file({'model.' + k: v for k, v in t.items()}, str(path))
    return path
