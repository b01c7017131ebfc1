"""The usage guide's Twinkle-client SFT script ("3.1 Twinkle Client: Fine-Grained Control"),
run against twinkle-server.

Changed from the guide: where the server is (base_url), the API key's source, the model id
(the server's model) and the dataset (a local self-cognition-style jsonl; the client never
downloads from a hub); and model.save also records the dataloader's consumed samples, as the
guide's "Resume from Checkpoint" section recommends. Each can be given as a flag or an environment
variable; the defaults match `build/bin/twinkle-server launch -c configs/default.yaml`:

    python examples/twinkle_sft_self_cognition.py
    python examples/twinkle_sft_self_cognition.py --base-url http://host:8000 --model-id Qwen/Qwen3.5-4B \
        --dataset ./self-cognition/self_cognition.jsonl          # key: TWINKLE_SERVER_TOKEN
"""
import argparse
import os
from pathlib import Path


def _settings():
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--base-url', default=os.environ.get('TWINKLE_SERVER_URL', 'http://127.0.0.1:8000'),
                        help="the server's HTTP address (or grpc://host:port); env TWINKLE_SERVER_URL")
    parser.add_argument('--model-id', default=os.environ.get('TWINKLE_MODEL_ID', 'tiny-qwen3'),
                        help="the server's base model; env TWINKLE_MODEL_ID")
    parser.add_argument('--dataset', default=os.environ.get('TWINKLE_DATASET',
                                                            str(here / 'data' / 'self_cognition.jsonl')),
                        help='a local self-cognition jsonl (query, response with {{NAME}}/{{AUTHOR}}); '
                        'env TWINKLE_DATASET')
    args, _ = parser.parse_known_args()
    # The key comes from the environment (never a flag: it would show in `ps`).
    args.api_key = os.environ.get('TWINKLE_SERVER_TOKEN', 'EMPTY_TOKEN')
    return args


ARGS = _settings()
MODEL_ID = ARGS.model_id
DATASET_PATH = ARGS.dataset

# ---------------------------------------------------------------------------------------
# From here on: the guide's script, with MODEL_ID / DATASET_PATH / ARGS in place of its
# hub ids, URL and key. (python-dotenv is optional here, as it is not an SDK dependency.)
try:
    import dotenv
    dotenv.load_dotenv('.env')
except ImportError:
    pass

from peft import LoraConfig

from twinkle import get_logger
from twinkle.dataset import DatasetMeta
from twinkle_client import init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()

# Initialize the Twinkle client
client = init_twinkle_client(base_url=ARGS.base_url, api_key=ARGS.api_key)

# Query existing training runs and checkpoints
runs = client.list_training_runs()
resume_path = None
for run in runs:
    logger.info(run.model_dump_json(indent=2))
    checkpoints = client.list_checkpoints(run.training_run_id)
    for checkpoint in checkpoints:
        logger.info(checkpoint.model_dump_json(indent=2))
        # Uncomment to resume from a specific checkpoint:
        # resume_path = checkpoint.twinkle_path


def train():
    # Prepare dataset
    dataset = Dataset(dataset_meta=DatasetMeta(DATASET_PATH, data_slice=range(500)))
    dataset.set_template('Qwen3_5Template', model_id=MODEL_ID, max_length=512)
    dataset.map('SelfCognitionProcessor', init_args={'model_name': 'twinkle model', 'model_author': 'ModelScope Community'})
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=4)

    # Configure model
    model = MultiLoraTransformersModel(model_id=MODEL_ID)

    lora_config = LoraConfig(target_modules='all-linear')
    model.add_adapter_to_model('default', lora_config, gradient_accumulation_steps=2)
    model.set_template('Qwen3_5Template')
    model.set_processor('InputProcessor', padding_side='right')
    model.set_loss('CrossEntropyLoss')
    model.set_optimizer('AdamW', lr=1e-4)
    model.set_lr_scheduler('LinearLR')

    # Resume from checkpoint if available
    if resume_path:
        logger.info(f'Resuming training from {resume_path}')
        model.load(resume_path, load_optimizer=True)

    logger.info(model.get_train_configs())

    for epoch in range(3):
        logger.info(f'Starting epoch {epoch}')
        for step, batch in enumerate(dataloader):
            # Forward + backward
            output = model.forward_backward(inputs=batch)

            if step % 2 == 0:
                logger.info(f'Current is step {step // 2}, loss: {output}')

            model.clip_grad_norm(1.0)
            model.step()
            model.zero_grad()
            model.lr_step()

        # Save checkpoint (with the dataloader's progress, as the guide's "Resume from
        # Checkpoint" section recommends, so a resume can skip the consumed samples)
        twinkle_path = model.save(name=f'twinkle-epoch-{epoch}', save_optimizer=True,
                                  consumed_train_samples=dataloader.get_state()['consumed_train_samples'])
        logger.info(f'Saved checkpoint: {twinkle_path}')


if __name__ == '__main__':
    train()
