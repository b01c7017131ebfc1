"""Two tenants train two LoRA adapters on one twinkle-server at the same time.

Each tenant has its own connection (its own API key when the server has auth on; its own
session either way), its own adapter, data, loss and optimizer settings, and runs the guide's
Twinkle-client loop in its own thread. The server fuses both tenants' work into shared
base-model passes; each adapter still gets exactly its own gradients. At the end both loss
curves are printed side by side.

    python examples/two_tenant_demo.py                           # against configs/default.yaml's server
    TWINKLE_KEY_A=tml-... TWINKLE_KEY_B=tml-... python examples/two_tenant_demo.py --base-url http://host:8000

Tenant A teaches the model that it is "twinkle model" by "ModelScope Community"; tenant B
that it is "Orion" by "Acme Labs", with another learning rate and LoRA rank. (The rates are
higher than the guide's 1e-4 so that the default server's tiny random model moves visibly in
a short run.)
"""
import argparse
import os
import threading
import time
from pathlib import Path

from peft import LoraConfig

from twinkle import get_logger
from twinkle.dataset import DatasetMeta
from twinkle_client import init_twinkle_client
from twinkle_client.dataloader import DataLoader
from twinkle_client.dataset import Dataset
from twinkle_client.manager import TwinkleClient
from twinkle_client.model import MultiLoraTransformersModel

logger = get_logger()

TENANTS = {
    'A': {'model_name': 'twinkle model', 'model_author': 'ModelScope Community', 'lr': 2e-3, 'r': 8},
    'B': {'model_name': 'Orion', 'model_author': 'Acme Labs', 'lr': 5e-3, 'r': 16},
}


def settings():
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--base-url', default=os.environ.get('TWINKLE_SERVER_URL', 'http://127.0.0.1:8000'),
                        help="the server's HTTP address (or grpc://host:port); env TWINKLE_SERVER_URL")
    parser.add_argument('--model-id', default=os.environ.get('TWINKLE_MODEL_ID', 'tiny-qwen3'),
                        help="the server's base model; env TWINKLE_MODEL_ID")
    parser.add_argument('--dataset', default=os.environ.get('TWINKLE_DATASET',
                                                            str(here / 'data' / 'self_cognition.jsonl')),
                        help='a local self-cognition jsonl; env TWINKLE_DATASET')
    parser.add_argument('--epochs', type=int, default=int(os.environ.get('TWINKLE_EPOCHS', 2)))
    parser.add_argument('--samples', type=int, default=int(os.environ.get('TWINKLE_SAMPLES', 96)),
                        help='rows per epoch (the file is repeated to fill them)')
    args, _ = parser.parse_known_args()
    default_key = os.environ.get('TWINKLE_SERVER_TOKEN', '')
    # Keys come from the environment (never flags: they would show in `ps`).
    args.keys = {'A': os.environ.get('TWINKLE_KEY_A', default_key), 'B': os.environ.get('TWINKLE_KEY_B', default_key)}
    return args


def tenant_dataset(args, tenant):
    spec = TENANTS[tenant]
    dataset = Dataset(dataset_meta=DatasetMeta(args.dataset, data_slice=range(args.samples)))
    dataset.set_template('Qwen3_5Template', model_id=args.model_id, max_length=512)
    dataset.map('SelfCognitionProcessor',
                init_args={'model_name': spec['model_name'], 'model_author': spec['model_author']})
    dataset.encode(batched=True)
    return dataset


def train_tenant(args, tenant, client: TwinkleClient, dataset, curve, errors):
    """The guide's Twinkle-client loop for one tenant; every micro-batch's loss goes to curve."""
    try:
        spec = TENANTS[tenant]
        dataloader = DataLoader(dataset=dataset, batch_size=4)
        model = MultiLoraTransformersModel(model_id=args.model_id, client=client)
        model.add_adapter_to_model('default', LoraConfig(target_modules='all-linear', r=spec['r'], lora_alpha=2 * spec['r']),
                                   gradient_accumulation_steps=2)
        model.set_template('Qwen3_5Template')
        model.set_processor('InputProcessor', padding_side='right')
        model.set_loss('CrossEntropyLoss')
        model.set_optimizer('AdamW', lr=spec['lr'])
        model.set_lr_scheduler('LinearLR')
        for epoch in range(args.epochs):
            for step, batch in enumerate(dataloader):
                output = model.forward_backward(inputs=batch)
                curve.append(output['loss'])
                if step % 4 == 0:
                    logger.info(f'tenant {tenant} epoch {epoch} step {step}: loss {output["loss"]:.4f}')
                model.clip_grad_norm(1.0)
                model.step()
                model.zero_grad()
                model.lr_step()
        path = model.save(name=f'tenant-{tenant.lower()}-final', save_optimizer=True,
                          consumed_train_samples=dataloader.get_state()['consumed_train_samples'])
        logger.info(f'tenant {tenant} saved {path}')
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors[tenant] = exc


def print_curves(curves):
    """Both curves side by side (every micro-batch) and a one-line sketch of each."""
    names = sorted(curves)
    print('\nstep  ' + '  '.join(f'{"tenant " + n:>10}' for n in names))
    for i in range(max(len(c) for c in curves.values())):
        cells = [f'{curves[n][i]:10.4f}' if i < len(curves[n]) else ' ' * 10 for n in names]
        print(f'{i:4d}  ' + '  '.join(cells))
    bars = ' ▁▂▃▄▅▆▇█'
    for n in names:
        c = curves[n]
        lo, hi = min(c), max(c)
        sketch = ''.join(bars[1 + int((v - lo) / (hi - lo + 1e-12) * 7.999)] for v in c)
        print(f'tenant {n}: {c[0]:.3f} -> {c[-1]:.3f}  {sketch}')


def main():
    args = settings()
    # One connection per tenant: its own key and session (the server isolates them).
    clients = {t: init_twinkle_client(base_url=args.base_url, api_key=args.keys[t]) if t == 'A'
               else TwinkleClient(args.base_url, args.keys[t]) for t in TENANTS}
    datasets = {t: tenant_dataset(args, t) for t in TENANTS}
    curves = {t: [] for t in TENANTS}
    errors = {}
    threads = [threading.Thread(target=train_tenant, args=(args, t, clients[t], datasets[t], curves[t], errors),
                                name=f'tenant-{t}') for t in TENANTS]
    started = time.time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for tenant, exc in errors.items():
        raise RuntimeError(f'tenant {tenant} failed: {exc}') from exc
    print_curves(curves)
    print(f'both tenants trained at once in {time.time() - started:.1f} s')
    for client in clients.values():
        client.close()


if __name__ == '__main__':
    main()
