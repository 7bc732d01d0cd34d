"""How well a run used its device: FLOPs per token, the device's peak, MFU and HFU."""
