"""`edgellm select`: choose model × quantization × backend × settings under a device's constraints."""
