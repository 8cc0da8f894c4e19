"""Data: ImageNet folder index, transforms, threaded loader, process baseline."""
