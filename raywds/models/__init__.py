"""Models by name from a table of sources (raywds.models.sources: torchvision, timm, demo), their
pretrained weights and preprocessing (raywds.models.weights), the classifier fitted to the data's
classes (raywds.models.head) and the fine-tuning controls (raywds.models.finetune). Never imports ray.

    from raywds.models.start import start_model
    start = start_model(ModelSettings(model="timm/test_resnet.r160_in1k", pretrained=True), classes)
"""
