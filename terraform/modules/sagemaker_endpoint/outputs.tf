output "endpoint_name" {
  description = "Endpoint name, for aws sagemaker-runtime invoke-endpoint."
  value       = aws_sagemaker_endpoint.ferry.name
}

output "model_data_uri" {
  description = "Where to upload the model data (model.tar.gz or the repository folder)."
  value       = local.model_uri
}

output "execution_role_arn" {
  description = "Role the endpoint runs as (read-only on the model bucket)."
  value       = aws_iam_role.execution.arn
}
