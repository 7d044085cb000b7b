# Vendored from diffusers' conversion script for Stable Audio Open (the test oracle: diffusers has no
# StableAudio from_single_file):
#   https://github.com/huggingface/diffusers/blob/58eb52c0803ea9af3abec60841c2a093bdf1f951/scripts/convert_stable_audio.py
# (last changed in commit 0fd58c7706ac69e046587c374320637c29b62b06).
#
# Copyright 2024 The HuggingFace Team. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Changes: only the key-conversion function is kept (the script's argument parsing, model downloads
# and pipeline saving run at import); its body is unchanged.
"""diffusers' ``convert_stable_audio_state_dict_to_diffusers``: stable-audio-tools' checkpoint
keys -> (StableAudioDiTModel, StableAudioProjectionModel, AutoencoderOobleck) state dicts."""

import torch


def convert_stable_audio_state_dict_to_diffusers(state_dict, num_autoencoder_layers=5):
    projection_model_state_dict = {
        k.replace("conditioner.conditioners.", "").replace("embedder.embedding", "time_positional_embedding"): v
        for (k, v) in state_dict.items()
        if "conditioner.conditioners" in k
    }

    # NOTE: we assume here that there's no projection layer from the text encoder to the latent space, script should be adapted a bit if there is.
    for key, value in list(projection_model_state_dict.items()):
        new_key = key.replace("seconds_start", "start_number_conditioner").replace(
            "seconds_total", "end_number_conditioner"
        )
        projection_model_state_dict[new_key] = projection_model_state_dict.pop(key)

    model_state_dict = {k.replace("model.model.", ""): v for (k, v) in state_dict.items() if "model.model." in k}
    for key, value in list(model_state_dict.items()):
        # attention layers
        new_key = (
            key.replace("transformer.", "")
            .replace("layers", "transformer_blocks")
            .replace("self_attn", "attn1")
            .replace("cross_attn", "attn2")
            .replace("ff.ff", "ff.net")
        )
        new_key = (
            new_key.replace("pre_norm", "norm1")
            .replace("cross_attend_norm", "norm2")
            .replace("ff_norm", "norm3")
            .replace("to_out", "to_out.0")
        )
        new_key = new_key.replace("gamma", "weight").replace("beta", "bias")  # replace layernorm

        # other layers
        new_key = (
            new_key.replace("project", "proj")
            .replace("to_timestep_embed", "timestep_proj")
            .replace("timestep_features", "time_proj")
            .replace("to_global_embed", "global_proj")
            .replace("to_cond_embed", "cross_attention_proj")
        )

        # we're using diffusers implementation of time_proj (GaussianFourierProjection) which creates a 1D tensor
        if new_key == "time_proj.weight":
            model_state_dict[key] = model_state_dict[key].squeeze(1)

        if "to_qkv" in new_key:
            q, k, v = torch.chunk(model_state_dict.pop(key), 3, dim=0)
            model_state_dict[new_key.replace("qkv", "q")] = q
            model_state_dict[new_key.replace("qkv", "k")] = k
            model_state_dict[new_key.replace("qkv", "v")] = v
        elif "to_kv" in new_key:
            k, v = torch.chunk(model_state_dict.pop(key), 2, dim=0)
            model_state_dict[new_key.replace("kv", "k")] = k
            model_state_dict[new_key.replace("kv", "v")] = v
        else:
            model_state_dict[new_key] = model_state_dict.pop(key)

    autoencoder_state_dict = {
        k.replace("pretransform.model.", "").replace("coder.layers.0", "coder.conv1"): v
        for (k, v) in state_dict.items()
        if "pretransform.model." in k
    }

    for key, _ in list(autoencoder_state_dict.items()):
        new_key = key
        if "coder.layers" in new_key:
            # get idx of the layer
            idx = int(new_key.split("coder.layers.")[1].split(".")[0])

            new_key = new_key.replace(f"coder.layers.{idx}", f"coder.block.{idx - 1}")

            if "encoder" in new_key:
                for i in range(3):
                    new_key = new_key.replace(f"block.{idx - 1}.layers.{i}", f"block.{idx - 1}.res_unit{i + 1}")
                new_key = new_key.replace(f"block.{idx - 1}.layers.3", f"block.{idx - 1}.snake1")
                new_key = new_key.replace(f"block.{idx - 1}.layers.4", f"block.{idx - 1}.conv1")
            else:
                for i in range(2, 5):
                    new_key = new_key.replace(f"block.{idx - 1}.layers.{i}", f"block.{idx - 1}.res_unit{i - 1}")
                new_key = new_key.replace(f"block.{idx - 1}.layers.0", f"block.{idx - 1}.snake1")
                new_key = new_key.replace(f"block.{idx - 1}.layers.1", f"block.{idx - 1}.conv_t1")

            new_key = new_key.replace("layers.0.beta", "snake1.beta")
            new_key = new_key.replace("layers.0.alpha", "snake1.alpha")
            new_key = new_key.replace("layers.2.beta", "snake2.beta")
            new_key = new_key.replace("layers.2.alpha", "snake2.alpha")
            new_key = new_key.replace("layers.1.bias", "conv1.bias")
            new_key = new_key.replace("layers.1.weight_", "conv1.weight_")
            new_key = new_key.replace("layers.3.bias", "conv2.bias")
            new_key = new_key.replace("layers.3.weight_", "conv2.weight_")

            if idx == num_autoencoder_layers + 1:
                new_key = new_key.replace(f"block.{idx - 1}", "snake1")
            elif idx == num_autoencoder_layers + 2:
                new_key = new_key.replace(f"block.{idx - 1}", "conv2")

        else:
            new_key = new_key

        value = autoencoder_state_dict.pop(key)
        if "snake" in new_key:
            value = value.unsqueeze(0).unsqueeze(-1)
        if new_key in autoencoder_state_dict:
            raise ValueError(f"{new_key} already in state dict.")
        autoencoder_state_dict[new_key] = value

    return model_state_dict, projection_model_state_dict, autoencoder_state_dict
