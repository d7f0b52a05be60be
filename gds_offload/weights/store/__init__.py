"""What lies on the drive: a store converted from a safetensors checkpoint (its data files, its
manifest, the config files it was converted with), a trained store's step generations, and
export back to safetensors. Opened as trusted, or refused with the command that fixes it."""
