"""The usage guide's Tinker-client SFT script ("3.2 Tinker Client: Simple and Ready to Use"),
run against twinkle-server's Tinker-compatible HTTP API with the official `tinker` SDK
(pip install 'twinkle-server-client[tinker]').

Changed from the guide, and nothing else: where the server is (base_url), the API key's
source, the base model (the server's model) and the dataset (a local self-cognition-style
jsonl; the client never downloads from a hub). Each can be given as a flag or an environment
variable; the defaults match `build/bin/twinkle-server launch -c configs/default.yaml`:

    python examples/tinker_sft.py
    python examples/tinker_sft.py --base-url http://host:8000 --base-model Qwen/Qwen3.5-4B \
        --dataset ./self-cognition/self_cognition.jsonl          # key: TINKER_API_KEY / TWINKLE_SERVER_TOKEN
"""
import argparse
import os
from pathlib import Path


def _settings():
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--base-url', default=(os.environ.get('TINKER_BASE_URL') or os.environ.get('TWINKLE_SERVER_URL')
                                               or 'http://127.0.0.1:8000'),
                        help="the server's HTTP address; env TINKER_BASE_URL or TWINKLE_SERVER_URL")
    parser.add_argument('--base-model', default=os.environ.get('TWINKLE_MODEL_ID', 'tiny-qwen3'),
                        help="the server's base model; env TWINKLE_MODEL_ID")
    parser.add_argument('--dataset', default=os.environ.get('TWINKLE_DATASET',
                                                            str(here / 'data' / 'self_cognition.jsonl')),
                        help='a local self-cognition jsonl (query, response with {{NAME}}/{{AUTHOR}}); '
                        'env TWINKLE_DATASET')
    args, _ = parser.parse_known_args()
    # The key comes from the environment (never a flag: it would show in `ps`). The guide reads
    # MODELSCOPE_TOKEN; a self-hosted server's key is TINKER_API_KEY or TWINKLE_SERVER_TOKEN.
    args.api_key = (os.environ.get('TINKER_API_KEY') or os.environ.get('TWINKLE_SERVER_TOKEN')
                    or os.environ.get('MODELSCOPE_TOKEN') or 'tml-EMPTY_TOKEN')
    # What init_tinker_client() reads (it also serves the template's tokenizer from the server).
    os.environ['TINKER_BASE_URL'] = args.base_url
    os.environ['TINKER_API_KEY'] = args.api_key
    return args


ARGS = _settings()

# ---------------------------------------------------------------------------------------
# From here on: the guide's script, with ARGS in place of its hub ids, URL and key.
from tinker import types
from tqdm import tqdm

from twinkle import init_tinker_client
from twinkle.dataloader import DataLoader
from twinkle.dataset import Dataset, DatasetMeta
from twinkle.preprocessor import SelfCognitionProcessor
from twinkle.server.common import input_feature_to_datum

# Initialize Tinker client (must be called before importing ServiceClient)
init_tinker_client()

from tinker import ServiceClient

# Base model
base_model = ARGS.base_model
base_url = ARGS.base_url


def train():
    # Prepare dataset
    dataset = Dataset(dataset_meta=DatasetMeta(ARGS.dataset, data_slice=range(500)))
    dataset.set_template('Qwen3_5Template', model_id=f'ms://{base_model}', max_length=256)
    dataset.map(SelfCognitionProcessor('Twinkle Model', 'ModelScope Team'), load_from_cache_file=False)
    dataset.encode(batched=True, load_from_cache_file=False)
    dataloader = DataLoader(dataset=dataset, batch_size=8)

    # Initialize training client
    service_client = ServiceClient(
        base_url=base_url,
        api_key=ARGS.api_key
    )
    training_client = service_client.create_lora_training_client(base_model=base_model, rank=16)

    # Training loop
    for epoch in range(3):
        print(f'Epoch {epoch}')
        for step, batch in tqdm(enumerate(dataloader)):
            # Convert input format
            input_datum = [input_feature_to_datum(input_feature) for input_feature in batch]

            # Remote forward + backward
            fwdbwd_future = training_client.forward_backward(input_datum, 'cross_entropy')
            # Remote optimizer step
            optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-4))

            # Wait for results
            fwdbwd_result = fwdbwd_future.result()
            optim_result = optim_future.result()
            print(f'Training Metrics: {optim_result}')

        # Save checkpoint
        save_future = training_client.save_state(f'twinkle-lora-{epoch}')
        save_result = save_future.result()
        print(f'Saved checkpoint to {save_result.path}')


if __name__ == '__main__':
    train()
