"""torchvision's names for Horovod's examples, over data and models that need neither a
download nor torchvision: ``from small_vision import datasets, transforms`` and ``from
small_vision import models`` take the place of ``from torchvision import ...``, and the
rest of the example runs as it is.

* ``datasets.MNIST(root, train=True, download=True, transform=None)``: scikit-learn's
  digits (1,797 8x8 images shipped inside scikit-learn, 1,437 for training and 360 held
  out, split by a fixed permutation), scaled to MNIST's 1x28x28 in [0, 1] so that
  Horovod's MNIST network runs unchanged; ``root`` and ``download`` are accepted and
  unused.
* ``transforms.Compose``, ``transforms.ToTensor`` (the images are tensors already) and
  ``transforms.Normalize(mean, std)``.
* ``models.resnet_small()``: a ResNet-like CNN with BatchNorm for 3x224x224 inputs and 1000
  classes (torchvision's resnet50's shapes) that two CPU cores train at tens of steps per
  second: a strided stem and two basic blocks. Pass ``--model resnet_small`` to
  pytorch_synthetic_benchmark.py.
"""
import functools

import torch
import torch.nn.functional as F


class transforms:
    class Compose:
        def __init__(self, steps):
            self.steps = list(steps)

        def __call__(self, x):
            for step in self.steps:
                x = step(x)
            return x

    class ToTensor:
        def __call__(self, x):
            return torch.as_tensor(x, dtype=torch.float32)

    class Normalize:
        def __init__(self, mean, std):
            self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
            self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

        def __call__(self, x):
            return (x - self.mean) / self.std


@functools.lru_cache(maxsize=None)
def _digits():
    """scikit-learn's digits at 1x28x28 in [0, 1], and their labels (read once per process:
    the training and the held-out set are two parts of them)."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False).clamp(0.0, 1.0)
    return images, torch.tensor(digits.target, dtype=torch.int64)


class _Digits(torch.utils.data.Dataset):
    def __init__(self, train, transform):
        images, targets = _digits()
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
        part = order[360:] if train else order[:360]
        self.images = images[part]
        self.targets = targets[part]
        self.transform = transform

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        x = self.images[i]
        return (self.transform(x) if self.transform is not None else x), int(self.targets[i])


class datasets:
    @staticmethod
    def MNIST(root, train=True, download=False, transform=None):
        return _Digits(train, transform)


class _Block(torch.nn.Module):
    """ResNet's basic block: two 3x3 convolutions with BatchNorm, and the shortcut."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class _ResNetSmall(torch.nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 7, 8, 3, bias=False), torch.nn.BatchNorm2d(16),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.layer1 = _Block(16, 16, 1)
        self.layer2 = _Block(16, 32, 2)
        self.fc = torch.nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class _Models:
    @staticmethod
    def resnet_small(num_classes=1000):
        return _ResNetSmall(num_classes)

    def __getattr__(self, name):
        raise AttributeError(f"models.{name}: torchvision's models need torchvision; this stand-in has "
                             "resnet_small (--model resnet_small)")


models = _Models()
